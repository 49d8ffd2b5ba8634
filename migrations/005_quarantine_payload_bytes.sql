-- A bytea payload (Protobuf, Avro, any bytes) is kept as the bytes it is,
-- apart from the JSON payload column, so the JSON column keeps its type and
-- what `quarantine list` shows of JSON events does not change; replay sends
-- the bytes back unchanged. Added to tables created before; run `migrate`
-- to upgrade.
ALTER TABLE {{quarantine}} ADD COLUMN IF NOT EXISTS payload_bytes bytea;
