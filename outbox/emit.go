package outbox

import (
	"context"
	"database/sql"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/messages"
)

// DefaultMessagePrefix is the prefix the relay's messages source reads by
// default (its --message-prefix).
const DefaultMessagePrefix = messages.DefaultPrefix

// Emitter writes events for the relay's messages source (run --source
// messages): each event is a transactional logical decoding message in the
// caller's transaction, with no outbox table. PostgreSQL decodes a message
// only if its transaction commits, in the transaction's order, so an event
// exists exactly when the business change does, as with Writer. It holds
// no connection and is safe for concurrent use.
type Emitter struct {
	prefix string
}

// NewEmitter returns an emitter for the relay's --message-prefix; empty
// means DefaultMessagePrefix.
func NewEmitter(prefix string) (*Emitter, error) {
	if prefix == "" {
		prefix = DefaultMessagePrefix
	}
	if strings.ContainsRune(prefix, 0) {
		return nil, errors.New("message prefix holds a NUL byte, which a message prefix cannot")
	}
	return &Emitter{prefix: prefix}, nil
}

// Emit emits the events within tx, in the order given, and returns their
// event IDs. The events are checked as Write checks them, and nothing is
// emitted unless every event is valid. The relay publishes each event
// exactly as it would publish the same row of the outbox table.
func (e *Emitter) Emit(ctx context.Context, tx pgx.Tx, events ...Event) ([]string, error) {
	return writeEvents(ctx, events, func(ctx context.Context, query string, args []any) error {
		_, err := tx.Exec(ctx, query, args...)
		return err
	}, e.statement, emitted)
}

// EmitSQL is Emit for a database/sql transaction (with the pgx stdlib
// driver or lib/pq).
func (e *Emitter) EmitSQL(ctx context.Context, tx *sql.Tx, events ...Event) ([]string, error) {
	return writeEvents(ctx, events, func(ctx context.Context, query string, args []any) error {
		_, err := tx.ExecContext(ctx, query, args...)
		return err
	}, e.statement, emitted)
}

func emitted(n int) string { return fmt.Sprintf("emit %d events", n) }

// statement emits one message per row, in the rows' order. PostgreSQL
// builds each content as jsonb and prints it, so the payload and headers
// reach the relay in the text the table source's jsonb columns would
// carry, and the relay's record is byte for byte the table source's. An
// event without OccurredAt gets now(), the table column's default.
func (e *Emitter) statement(rows []row) (string, []any) {
	var b strings.Builder
	b.WriteString(`SELECT count(pg_logical_emit_message(true, $1, (jsonb_build_object(
		'event_id', e.event_id, 'aggregate_type', e.aggregate_type, 'aggregate_id', e.aggregate_id,
		'event_type', e.event_type, 'schema_version', e.schema_version,
		'occurred_at', coalesce(e.occurred_at, now()))
		|| CASE WHEN e.payload_base64 IS NULL THEN jsonb_build_object('payload', e.payload)
			ELSE jsonb_build_object('payload_base64', e.payload_base64) END
		|| CASE WHEN e.headers IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('headers', e.headers) END)::text))
	FROM (VALUES `)
	args := make([]any, 1, 1+len(rows)*9)
	args[0] = e.prefix
	param := func(v any, cast string) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args)) + "::" + cast
	}
	for i, r := range rows {
		if i > 0 {
			b.WriteByte(',')
		}
		// JSON has no bytes: a raw payload goes base64 in payload_base64.
		var payload, payloadBase64 any = r.payload, nil
		if r.raw {
			payload, payloadBase64 = nil, base64.StdEncoding.EncodeToString(r.payload.([]byte))
		}
		b.WriteString("(" + param(r.id, "uuid") + "," + param(r.aggregateType, "text") + "," + param(r.aggregateID, "text") + "," +
			param(r.eventType, "text") + "," + param(r.schemaVersion, "int") + "," + param(payload, "jsonb") + "," +
			param(payloadBase64, "text") + "," + param(r.headers, "jsonb") + "," + param(r.occurredAt, "timestamptz") + ")")
	}
	b.WriteString(`) AS e(event_id, aggregate_type, aggregate_id, event_type, schema_version, payload, payload_base64, headers, occurred_at)`)
	return b.String(), args
}
