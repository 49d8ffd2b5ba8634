-- The relay's own record of the replication slots it made, one row a slot.
-- A missing slot means two different things: a first start, or a history
-- lost (the slot dropped, or a failover to a server without it). Kafka
-- alone cannot tell them apart (its progress topic can be deleted too), and
-- the outbox table cannot either (its rows are there in both cases). This
-- row is written, on the same server as the data and replicated with it,
-- when `run` or `migrate` makes the slot; a relay that finds the slot
-- missing while its row is here knows the slot is lost and never makes a
-- new one over the gap without being told (docs/slot-trouble.md).
--
-- Every role may read and write it: the relay's role makes slots and needs
-- no grant on the outbox. A row someone else forged or changed can only
-- make the relay stop and ask, or republish; it can never make it skip
-- rows, which only --existing-rows published does.
CREATE TABLE IF NOT EXISTS {{slots}} (
    slot_name      text        PRIMARY KEY,
    outbox_table   text        NOT NULL,
    consistent_lsn pg_lsn      NOT NULL,
    created_at     timestamptz NOT NULL,
    created_by     text        NOT NULL,
    existing_rows  text        NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT, INSERT, UPDATE ON {{slots}} TO PUBLIC;
