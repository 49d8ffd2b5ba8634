-- Insertion order. Within one transaction nothing else in a row says which
-- event came first: created_at is the transaction's start, WAL replay sets
-- every row's cmin to 0 (so on a promoted standby all of them are equal),
-- and ctid follows free space, so a small row can land on a page before a
-- larger one inserted just ahead of it. Republishing (reconcile, and the
-- recovery of a lost slot) reads rows by this number, so two events of one
-- aggregate go out in the order they were written.
--
-- The column is added without a default and given one after: a volatile
-- default in ADD COLUMN would rewrite the whole table. Rows from before keep
-- NULL and are ordered as before. A column with a default already keeps it:
-- poll mode's snapshot strategy may number the rows with its own sequence.
DO $migrate$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = {{table_literal}}::regclass AND attname = 'outbox_relay_seq' AND NOT attisdropped) THEN
        ALTER TABLE {{table}} ADD COLUMN outbox_relay_seq bigint;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
                   WHERE d.adrelid = {{table_literal}}::regclass AND a.attname = 'outbox_relay_seq') THEN
        CREATE SEQUENCE IF NOT EXISTS {{order_seq}} OWNED BY {{table}}.outbox_relay_seq;
        -- A writer needs INSERT on the outbox only: the numbers order rows
        -- and mean nothing else, so anyone may take one.
        GRANT USAGE ON SEQUENCE {{order_seq}} TO PUBLIC;
        ALTER TABLE {{table}} ALTER COLUMN outbox_relay_seq SET DEFAULT nextval({{order_seq_literal}});
    END IF;
END
$migrate$;
