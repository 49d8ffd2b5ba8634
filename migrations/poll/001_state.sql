-- Poll mode (`outbox-relay run --source poll`): the publication state of each
-- outbox row, in a table beside the outbox rather than in columns of it.
-- Measured on PostgreSQL 15 with 20,000 events of a 300-byte payload, claimed
-- and marked in batches of 100: state columns in the outbox table cost 3,583
-- bytes of WAL per event (955 insert, 2,628 claim and mark, since each update
-- rewrites the whole row with its payload) and bloated the table from 12 to 39
-- MB; this table costs 2,011 (1,125 insert with the trigger's row, 886 claim
-- and mark), its dead tuples are 100-byte rows, and the outbox stays
-- insert-only, as the WAL relay and `reconcile` expect. Room left in each
-- page (fillfactor) lets a claim, which changes no indexed column, update
-- its rows in place (HOT) without new index entries.
DO $migrate$
BEGIN
    IF to_regclass({{poll_literal}}) IS NULL THEN
        EXECUTE format($sql$
            CREATE TABLE %s (
                -- Insertion order, the meaning of "earlier" for per-aggregate
                -- order: taken when the row is inserted, under the writer's
                -- lock on the aggregate.
                seq              bigint      PRIMARY KEY,
                event_id         %s          NOT NULL,
                aggregate_type   text        NOT NULL,
                aggregate_id     text        NOT NULL,
                inserted_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
                attempts         int         NOT NULL DEFAULT 0,
                next_attempt_at  timestamptz NOT NULL DEFAULT '-infinity',
                lease_holder     text,
                lease_expires_at timestamptz,
                last_error_class text,
                last_error       text,
                published_at     timestamptz,
                quarantined_at   timestamptz
            ) WITH (fillfactor = 70)$sql$, {{poll_literal}},
            (SELECT format_type(atttypid, atttypmod) FROM pg_attribute
             WHERE attrelid = {{table_literal}}::regclass AND attname = {{event_id_literal}} AND NOT attisdropped));
    END IF;
END
$migrate$;

CREATE SEQUENCE IF NOT EXISTS {{poll_seq}};

-- What a poller claims: only rows still to publish, so the index stays the
-- size of the backlog however large the table grows.
CREATE INDEX IF NOT EXISTS {{poll_pending_index}} ON {{poll}} (seq)
    WHERE published_at IS NULL AND quarantined_at IS NULL;
-- Whether an earlier event of the same aggregate is still unpublished
-- (claimed elsewhere, backing off or quarantined).
CREATE INDEX IF NOT EXISTS {{poll_aggregate_index}} ON {{poll}} (aggregate_type, aggregate_id, seq)
    WHERE published_at IS NULL;

-- The quarantined rows still waiting for a replay, which the poller settles
-- once `quarantine replay` delivered them.
CREATE INDEX IF NOT EXISTS {{poll_quarantined_index}} ON {{poll}} (seq)
    WHERE quarantined_at IS NOT NULL AND published_at IS NULL;

-- One statement-level trigger: one INSERT ... SELECT per statement, and one
-- wake-up for pollers, delivered by PostgreSQL at commit. PostgreSQL
-- refuses PREPARE TRANSACTION after a NOTIFY, so `migrate
-- --poll-notify=false` leaves the wake-up out for writers that use
-- two-phase commit; the pollers then look every --poll-interval.
-- SECURITY DEFINER: a writer needs INSERT on the outbox only, not rights on
-- the state table; every name inside is schema-qualified, and the search
-- path is pinned so no writer's schema can stand in for one.
CREATE OR REPLACE FUNCTION {{poll_track}}() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $migrate$
BEGIN
    INSERT INTO {{poll}} (seq, event_id, aggregate_type, aggregate_id)
    SELECT nextval({{poll_seq_literal}}), {{event_id}}, {{aggregate_type}}, {{aggregate_id}} FROM outbox_relay_new_rows;
    {{poll_notify}}
    RETURN NULL;
END
$migrate$;

CREATE OR REPLACE TRIGGER {{poll_trigger}} AFTER INSERT ON {{table}}
    REFERENCING NEW TABLE AS outbox_relay_new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {{poll_track}}();

-- Rows written before the trigger existed are tracked too, as pending unless
-- `migrate --poll-existing published` says another relay published them all:
-- a poller that skipped them could lose events. `migrate` says how many.
-- Oldest first, so each aggregate's rows keep their order: in insertion
-- order (outbox_relay_seq) where the table numbers its rows, else by
-- insert time when the table has that column.
--
-- A switch back from the snapshot strategy: "published" then means what
-- its progress row says, so a row it had not published yet (written
-- after its poller stopped, or in a window it had not finished) stays
-- pending; only the rows it covers are taken as published.
DO $migrate$
DECLARE
    oldest_first text := '';
    published text := {{existing_published_at_literal}};
BEGIN
    IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = {{table_literal}}::regclass
               AND attname = 'outbox_relay_seq' AND NOT attisdropped) THEN
        oldest_first := 'outbox_relay_seq NULLS FIRST, ';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = {{table_literal}}::regclass
               AND attname = {{created_at_literal}} AND NOT attisdropped) THEN
        oldest_first := oldest_first || format('%I, %I', {{created_at_literal}}, {{event_id_literal}});
    ELSE
        oldest_first := oldest_first || format('%I', {{event_id_literal}});
    END IF;
    IF published <> 'NULL::timestamptz' AND to_regclass({{snap_literal}}) IS NOT NULL
       AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = {{table_literal}}::regclass AND attname = 'outbox_relay_xid' AND NOT attisdropped) THEN
        published := format('(SELECT CASE WHEN CASE WHEN o.outbox_relay_xid IS NULL THEN NOT p.existing_pending
                                                    ELSE pg_visible_in_snapshot(o.outbox_relay_xid, p.done) END
                                   THEN now() END FROM %s p)', {{snap_literal}});
    END IF;
    EXECUTE format($sql$
        INSERT INTO {{poll}} (seq, event_id, aggregate_type, aggregate_id, published_at)
        SELECT nextval(%L), o.%I, o.%I, o.%I, %s
        FROM (SELECT * FROM {{table}} o
              WHERE NOT EXISTS (SELECT 1 FROM {{poll}} s WHERE s.event_id = o.%I)
              ORDER BY %s) o$sql$,
        {{poll_seq_literal}}, {{event_id_literal}}, {{aggregate_type_literal}}, {{aggregate_id_literal}}, published, {{event_id_literal}}, oldest_first);
END
$migrate$;
