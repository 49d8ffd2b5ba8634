-- Poll mode's snapshot strategy (`--poll-strategy snapshot`), as Skytools'
-- PgQ reads its queues: each outbox row records its transaction's id, and a
-- poller reads, per batch, exactly the rows whose transactions became
-- visible between the last snapshot it published and a new one. Nothing is
-- written per event beyond the insert itself: the progress is one row,
-- updated once per page of events.
--
-- The columns are added without a default and given one after: a volatile
-- default in ADD COLUMN would rewrite the whole table. Rows inserted before
-- keep NULLs; `--poll-existing` says whether they are published. ALTER
-- TABLE waits for every transaction that inserted into the table to end,
-- so every row without a transaction id is committed when this commits.
ALTER TABLE {{table}}
    ADD COLUMN IF NOT EXISTS outbox_relay_xid xid8,
    ADD COLUMN IF NOT EXISTS outbox_relay_seq bigint;
-- pg_current_xact_id() is the top-level transaction's id, inside a
-- savepoint too, which is what snapshots list.
ALTER TABLE {{table}}
    ALTER COLUMN outbox_relay_xid SET DEFAULT pg_current_xact_id();
-- The sequence number is insertion order, the meaning of "earlier" for
-- per-aggregate order within a batch, as in the lease strategy. The
-- relay's own table is numbered already (007_outbox_order.sql), and a
-- column numbered by one sequence must not start over from another: the
-- progress row holds a number. So only a column without a default, which
-- another tool's table has, gets this one.
DO $migrate$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
                   WHERE d.adrelid = {{table_literal}}::regclass AND a.attname = 'outbox_relay_seq') THEN
        CREATE SEQUENCE IF NOT EXISTS {{snap_seq}};
        -- Every writer's insert takes a number from it, and a writer needs
        -- INSERT on the outbox only: the numbers order rows and mean
        -- nothing else, so anyone may take one.
        GRANT USAGE ON SEQUENCE {{snap_seq}} TO PUBLIC;
        ALTER TABLE {{table}} ALTER COLUMN outbox_relay_seq SET DEFAULT nextval({{snap_seq_literal}});
    END IF;
END
$migrate$;

-- The one index a batch reads: its transactions' rows, by id.
CREATE INDEX IF NOT EXISTS {{snap_xid_index}} ON {{table}} (outbox_relay_xid)
    WHERE outbox_relay_xid IS NOT NULL;

-- The progress: the last snapshot whose rows Kafka acknowledged (done),
-- the window being published (window_end, and the last sequence number of
-- it acknowledged), and the rows from before this migration still to
-- publish. One row per outbox table.
CREATE TABLE IF NOT EXISTS {{snap}} (
    one                    boolean     PRIMARY KEY DEFAULT true CHECK (one),
    done                   pg_snapshot NOT NULL,
    window_end             pg_snapshot,
    window_after_seq       bigint,
    existing_pending       boolean     NOT NULL,
    existing_after_created timestamptz,
    existing_after_id      text,
    updated_at             timestamptz NOT NULL DEFAULT now()
);
-- A switch from the lease strategy: its state table says which rows from
-- before were published (existing_by_lease_state), and its pending ones
-- are published first, in its order (its seq, after existing_after_seq).
-- Added apart, for a progress table from before: a constant default
-- changes no row.
ALTER TABLE {{snap}}
    ADD COLUMN IF NOT EXISTS existing_by_lease_state boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS existing_after_seq      bigint;
-- Taken after ALTER TABLE's lock: every row with a transaction id visible
-- in it is older than the column's default, so none exists yet, and
-- every row without one is committed.
--
-- --poll-existing published means "published" as far as anyone knows: a
-- row the lease strategy's state table holds as pending (neither
-- published nor quarantined) is still pending, and is published first;
-- only rows it has no state for are taken as published on the operator's
-- word. Without this, a switch from the lease strategy lost every event
-- written between the lease pollers' stop and this migration.
DO $migrate$
DECLARE
    by_lease boolean := {{existing_published}} AND to_regclass({{poll_literal}}) IS NOT NULL;
    pending  boolean := false;
BEGIN
    IF NOT {{existing_published}} THEN
        pending := EXISTS (SELECT 1 FROM {{table}} WHERE outbox_relay_xid IS NULL);
    ELSIF by_lease THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s s JOIN %s o ON o.%I = s.event_id
            WHERE s.published_at IS NULL AND s.quarantined_at IS NULL AND o.outbox_relay_xid IS NULL)',
            {{poll_literal}}, {{table_literal}}, {{event_id_literal}}) INTO pending;
    END IF;
    INSERT INTO {{snap}} (done, existing_pending, existing_by_lease_state)
    SELECT pg_current_snapshot(), pending, by_lease
    ON CONFLICT (one) DO NOTHING;
END
$migrate$;

-- A wake-up for the poller at commit, one per statement. It writes
-- nothing. PostgreSQL refuses PREPARE TRANSACTION after a NOTIFY, so
-- `migrate --poll-notify=false` leaves it out (and drops it) for writers
-- that use two-phase commit; the poller then looks every --poll-interval.
CREATE OR REPLACE FUNCTION {{snap_notify}}() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $migrate$
BEGIN
    PERFORM pg_notify('outbox_relay_poll', {{table_literal}});
    RETURN NULL;
END
$migrate$;

{{snap_notify_trigger}}
