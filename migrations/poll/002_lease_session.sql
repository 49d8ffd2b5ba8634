-- The PostgreSQL session that holds each lease: its backend's PID and start
-- time, which together name one session for the server's life (a PID alone
-- can be reused). A lease whose session no longer exists in
-- pg_stat_activity is free at once: its poller died, whatever its worker id,
-- and need not wait out --poll-lease. NULL (a poller with
-- --poll-session-check=false, or a lease taken before this step) falls back
-- to the lease's expiry. ADD COLUMN ... IF NOT EXISTS: a table made by an
-- earlier release gets them when `migrate --source poll` runs again; nullable
-- columns with no default change no existing row.
ALTER TABLE {{poll}}
    ADD COLUMN IF NOT EXISTS lease_pid           int,
    ADD COLUMN IF NOT EXISTS lease_backend_start timestamptz;
