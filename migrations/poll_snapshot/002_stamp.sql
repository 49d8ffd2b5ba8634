-- The snapshot strategy reads a row by its transaction id: a row whose
-- outbox_relay_xid is NULL or another transaction's would never be in any
-- window, and retention would delete it as covered. The column's default
-- is not enough: an ORM that inserts every mapped column, an INSERT ...
-- SELECT * copy or a copy tool sets it, to NULL or to a stale value. So
-- the trigger that numbers the rows also stamps each with its own
-- transaction's id (the same DO block as 008_outbox_stamp.sql, which now
-- finds the column).
{{stamp}}
