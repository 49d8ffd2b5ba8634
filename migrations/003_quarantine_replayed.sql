-- `quarantine replay` keeps each event it delivered, marked with when and to
-- which topic, so `reconcile` counts it as delivered and never sends the
-- original row again. Added to tables created before; run `migrate` to upgrade.
ALTER TABLE {{quarantine}}
    ADD COLUMN IF NOT EXISTS replayed_at    timestamptz,
    ADD COLUMN IF NOT EXISTS replayed_topic text;
