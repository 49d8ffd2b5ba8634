-- Publish inserts only: the relay never needs updates, and cleanup deletes
-- must not reach it. A partitioned outbox table is published through its
-- root (publish_via_partition_root): otherwise the publication lists only
-- the partitions, the stream names them instead of the table, and the
-- relay would not find the table in it.
DO $migrate$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = {{publication_literal}}) THEN
        IF (SELECT relkind FROM pg_class WHERE oid = {{table_literal}}::regclass) = 'p' THEN
            CREATE PUBLICATION {{publication}} FOR TABLE {{table}} WITH (publish = 'insert', publish_via_partition_root = true);
        ELSE
            CREATE PUBLICATION {{publication}} FOR TABLE {{table}} WITH (publish = 'insert');
        END IF;
    END IF;
END
$migrate$;
