-- The outbox table. Services insert one row per event in the same transaction
-- as their business change.
CREATE TABLE IF NOT EXISTS {{table}} (
    event_id       uuid        PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    schema_version int         NOT NULL DEFAULT 1,
    payload        jsonb       NOT NULL,
    -- Extra Kafka headers, e.g. {"tenant": "acme", "traceparent": "00-..."}.
    headers        jsonb,
    occurred_at    timestamptz NOT NULL DEFAULT now(),
    created_at     timestamptz NOT NULL DEFAULT now(),
    -- Reject at insert time what Kafka could never carry, so the writing
    -- service sees the error instead of the relay.
    CONSTRAINT {{headers_check}} CHECK (
        headers IS NULL OR (
            jsonb_typeof(headers) = 'object'
            AND NOT headers ?| ARRAY['event_id', 'event_type', 'aggregate_type', 'aggregate_id', 'schema_version', 'occurred_at']
        )
    )
);

-- Retention deletes by age.
CREATE INDEX IF NOT EXISTS {{created_at_index}} ON {{table}} (created_at);
