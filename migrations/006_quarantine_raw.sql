-- What a writer emitted cannot always be kept in the typed columns: text
-- and jsonb refuse U+0000, and a jsonb string stops at 256 MB. The relay
-- then keeps the content exactly as it arrived in raw, puts reversible
-- escapes or placeholders in the typed columns, and says which in
-- content_problem; a content too large to keep at all is kept by
-- reference (raw_lsn, raw_size, raw_sha256). A row whose content_problem
-- is set is no event as it stands: `quarantine replay` refuses it until
-- the operator fixes the row and clears content_problem. Added to tables
-- created before; run `migrate` to upgrade.
ALTER TABLE {{quarantine}}
    ADD COLUMN IF NOT EXISTS raw             bytea,
    ADD COLUMN IF NOT EXISTS raw_size        bigint,
    ADD COLUMN IF NOT EXISTS raw_sha256      bytea,
    ADD COLUMN IF NOT EXISTS raw_lsn         pg_lsn,
    ADD COLUMN IF NOT EXISTS content_problem text;
