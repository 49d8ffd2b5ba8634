-- Publish inserts only: the relay never needs updates, and cleanup deletes
-- must not reach it.
DO $migrate$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = {{publication_literal}}) THEN
        CREATE PUBLICATION {{publication}} FOR TABLE {{table}} WITH (publish = 'insert');
    END IF;
END
$migrate$;
