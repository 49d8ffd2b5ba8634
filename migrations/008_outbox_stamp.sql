-- The relay's own columns are the relay's, never the writer's: a BEFORE
-- INSERT trigger sets them on every row, whatever the INSERT said.
{{stamp}}
