-- The messages source reads events from logical decoding messages, which
-- pgoutput sends to every slot whatever its publication holds; it still
-- needs a publication to name. One with no table publishes no row, so the
-- walsender decodes nothing else for this slot.
DO $migrate$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = {{publication_literal}}) THEN
        CREATE PUBLICATION {{publication}};
    END IF;
END
$migrate$;
