package relay

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Permanent-error policies, chosen by --on-permanent-error.
const (
	OnPermanentQuarantine = "quarantine"
	OnPermanentHalt       = "halt"
)

// Quarantined is one event Kafka would not accept, as it is kept in the
// quarantine table. Text fields hold PostgreSQL's text forms.
type Quarantined struct {
	EventID, AggregateType, AggregateID, EventType, SchemaVersion string
	Payload, Headers, OccurredAt                                  string // Headers and OccurredAt may be empty
	Topic, ErrorClass, ErrorMessage                               string
	Attempts                                                      int
	FirstFailedAt, LastFailedAt                                   time.Time
}

// QuarantineStore reads and writes the quarantine table. It is safe for
// concurrent use: the read loop and the producer's outcome goroutine both
// quarantine events.
type QuarantineStore struct {
	mu    sync.Mutex
	admin *replication.Admin
	table string // quoted, schema-qualified
}

// OpenQuarantine connects to the database for the quarantine table.
func OpenQuarantine(ctx context.Context, cfg replication.Config, schema, table string) (*QuarantineStore, error) {
	admin, err := replication.Connect(ctx, cfg)
	if err != nil {
		return nil, err
	}
	q := &QuarantineStore{admin: admin, table: pgx.Identifier{schema, table}.Sanitize()}
	var exists bool
	if err := admin.Conn().QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", q.table).Scan(&exists); err != nil {
		admin.Close(context.Background())
		return nil, fmt.Errorf("look up quarantine table: %w", err)
	}
	if !exists {
		admin.Close(context.Background())
		return nil, fmt.Errorf("%w: quarantine table %s does not exist: run `outbox-relay migrate`, or use --on-permanent-error halt",
			replication.ErrPrecondition, q.table)
	}
	return q, nil
}

// Close closes the connection.
func (q *QuarantineStore) Close() error { return q.admin.Close(context.Background()) }

// Put stores an event, or counts one more attempt of an event already
// there. It returns once the row is committed, so the caller may then let
// the slot pass the event.
func (q *QuarantineStore) Put(ctx context.Context, e Quarantined) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	headers := &e.Headers
	if e.Headers == "" {
		headers = nil
	}
	occurred := &e.OccurredAt
	if e.OccurredAt == "" {
		occurred = nil
	}
	version := e.SchemaVersion
	if version == "" {
		version = "1"
	}
	_, err := q.admin.Conn().Exec(ctx, `
		INSERT INTO `+q.table+` AS q (event_id, aggregate_type, aggregate_id, event_type, schema_version, payload, headers,
			occurred_at, topic, error_class, error_message)
		VALUES ($1, $2, $3, $4, $5::int, $6::jsonb, $7::jsonb, $8::timestamptz, $9, $10, $11)
		ON CONFLICT (event_id) DO UPDATE SET attempts = q.attempts + 1, last_failed_at = now(),
			topic = excluded.topic, error_class = excluded.error_class, error_message = excluded.error_message`,
		e.EventID, e.AggregateType, e.AggregateID, e.EventType, version, e.Payload, headers, occurred,
		e.Topic, e.ErrorClass, e.ErrorMessage)
	if err != nil {
		return fmt.Errorf("quarantine event %s: %w", e.EventID, err)
	}
	return nil
}

// Count returns how many events are quarantined.
func (q *QuarantineStore) Count(ctx context.Context) (int64, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	var n int64
	if err := q.admin.Conn().QueryRow(ctx, "SELECT count(*) FROM "+q.table).Scan(&n); err != nil {
		return 0, fmt.Errorf("count quarantined events: %w", err)
	}
	return n, nil
}

// List returns quarantined events, oldest first; eventID narrows it to one.
func (q *QuarantineStore) List(ctx context.Context, eventID string) ([]Quarantined, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	query := `SELECT event_id::text, aggregate_type, aggregate_id, event_type, schema_version::text, payload::text,
		COALESCE(headers::text, ''), COALESCE(occurred_at::text, ''), topic, error_class, error_message, attempts,
		first_failed_at, last_failed_at FROM ` + q.table
	var args []any
	if eventID != "" {
		query += " WHERE event_id = $1::uuid"
		args = append(args, eventID)
	}
	rows, err := q.admin.Conn().Query(ctx, query+" ORDER BY first_failed_at, event_id", args...)
	if err != nil {
		return nil, fmt.Errorf("list quarantined events: %w", err)
	}
	defer rows.Close()
	var out []Quarantined
	for rows.Next() {
		var e Quarantined
		if err := rows.Scan(&e.EventID, &e.AggregateType, &e.AggregateID, &e.EventType, &e.SchemaVersion, &e.Payload,
			&e.Headers, &e.OccurredAt, &e.Topic, &e.ErrorClass, &e.ErrorMessage, &e.Attempts, &e.FirstFailedAt, &e.LastFailedAt); err != nil {
			return nil, fmt.Errorf("read quarantined event: %w", err)
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list quarantined events: %w", err)
	}
	return out, nil
}

// Remove deletes an event from quarantine; call it only after Kafka
// acknowledged the replayed event.
func (q *QuarantineStore) Remove(ctx context.Context, eventID string) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if _, err := q.admin.Conn().Exec(ctx, "DELETE FROM "+q.table+" WHERE event_id = $1::uuid", eventID); err != nil {
		return fmt.Errorf("remove event %s from quarantine: %w", eventID, err)
	}
	return nil
}

// fromEvent describes an event that failed before it was sent.
func fromEvent(ev *publisher.Event, perr *publisher.Error) Quarantined {
	return Quarantined{
		EventID: string(ev.EventID), AggregateType: string(ev.AggregateType), AggregateID: string(ev.AggregateID),
		EventType: string(ev.EventType), SchemaVersion: string(ev.SchemaVersion), Payload: string(ev.Payload),
		Headers: string(ev.Headers), OccurredAt: string(ev.OccurredAt),
		Topic: perr.Topic, ErrorClass: string(perr.Class), ErrorMessage: perr.Error(),
	}
}

// fromRecord describes an event whose record Kafka rejected.
func fromRecord(r *publisher.Record, perr *publisher.Error) Quarantined {
	return Quarantined{
		EventID: r.EventID(), AggregateType: string(r.Header("aggregate_type")), AggregateID: string(r.Key()),
		EventType: string(r.Header("event_type")), SchemaVersion: string(r.Header("schema_version")),
		Payload: string(r.Value()), Headers: string(r.RowHeaders()), OccurredAt: string(r.Header("occurred_at")),
		Topic: perr.Topic, ErrorClass: string(perr.Class), ErrorMessage: perr.Error(),
	}
}

// Event turns a quarantined row back into an event to publish again.
func (e *Quarantined) Event() *publisher.Event {
	ev := &publisher.Event{
		EventID: []byte(e.EventID), AggregateType: []byte(e.AggregateType), AggregateID: []byte(e.AggregateID),
		EventType: []byte(e.EventType), SchemaVersion: []byte(e.SchemaVersion), Payload: []byte(e.Payload),
		OccurredAt: []byte(e.OccurredAt),
	}
	if e.Headers != "" {
		ev.Headers = []byte(e.Headers)
	}
	return ev
}
