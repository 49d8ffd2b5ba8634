-- The relay's record of the partition count each event topic's keys are
-- mapped by, one row a topic. Adding partitions to a topic would move most
-- keys at once (murmur2 modulo the new count) while their earlier records
-- still wait unread in the old partitions; the relay instead keeps mapping
-- keys by the count recorded here the first time it published to the
-- topic, until an operator adopts the new one with `outbox-relay
-- partitions adopt` (docs/partitions.md). Kept beside the data, not in
-- Kafka: the progress topic can be deleted, and every source (wal,
-- messages, poll) reaches this database.
--
-- Every role may read and write it, as the slot registry: the relay's role
-- records a topic's count the first time it meets the topic. A row someone
-- changed can only make the relay map keys by another count that the topic
-- has, or stop.
CREATE TABLE IF NOT EXISTS {{partitions}} (
    topic       text        PRIMARY KEY,
    partitions  integer     NOT NULL CHECK (partitions > 0),
    recorded_at timestamptz NOT NULL DEFAULT now(),
    recorded_by text        NOT NULL,
    previous    integer
);
GRANT SELECT, INSERT, UPDATE ON {{partitions}} TO PUBLIC;
