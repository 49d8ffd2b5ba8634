-- Events Kafka will never accept as they are (too large, invalid topic, not
-- authorized), kept whole so nothing is lost and the line does not stop.
-- `outbox-relay quarantine list` shows them; `quarantine replay` publishes
-- them again with the same event_id and, only after Kafka's ack, marks each
-- replayed (003).
CREATE TABLE IF NOT EXISTS {{quarantine}} (
    event_id        uuid        PRIMARY KEY,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    schema_version  int         NOT NULL DEFAULT 1,
    payload         jsonb       NOT NULL,
    headers         jsonb,
    occurred_at     timestamptz,
    topic           text        NOT NULL,
    error_class     text        NOT NULL,
    error_message   text        NOT NULL,
    attempts        int         NOT NULL DEFAULT 1,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now()
);
