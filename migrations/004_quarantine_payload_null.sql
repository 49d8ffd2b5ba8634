-- Debezium's outbox layout publishes a SQL NULL payload as a record with a
-- null value, so the quarantine table must keep a NULL payload apart from a
-- JSON null. The relay's own layout never stores one. Run `migrate` to upgrade.
ALTER TABLE {{quarantine}} ALTER COLUMN payload DROP NOT NULL;
