package store

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/publisher"
)

// eventColumns are the outbox columns an event is built from, read in the
// text forms the replication stream delivers, so a record built from an
// SQL read (reconcile, poll mode) is byte for byte what the WAL path sends.
// The optional ones may be missing from the table: the WAL path maps
// columns by name and takes a missing one as NULL, and so do SQL readers.
var eventColumns = []struct {
	name, expr string
	optional   bool
}{
	{"event_id", "event_id::text", false},
	{"aggregate_type", "aggregate_type", false},
	{"aggregate_id", "aggregate_id", false},
	{"event_type", "event_type", false},
	{"schema_version", "schema_version::text", true},
	{"payload", "payload::text", false},
	{"headers", "headers::text", true},
	{"occurred_at", "occurred_at::text", true},
}

// EventColumns is the SELECT list that reads an event from the outbox
// table, each column qualified with alias when it is not empty, and NULL
// for each optional column the table lacks. EventFromRow reads its values.
func EventColumns(ctx context.Context, conn *pgx.Conn, outbox Table, alias string) (string, error) {
	rows, err := conn.Query(ctx, `SELECT attname FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped`, outbox.Quoted())
	if err != nil {
		return "", fmt.Errorf("read the outbox table's columns: %w", err)
	}
	present := map[string]bool{}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			rows.Close()
			return "", fmt.Errorf("read the outbox table's columns: %w", err)
		}
		present[name] = true
	}
	if err := rows.Err(); err != nil {
		return "", fmt.Errorf("read the outbox table's columns: %w", err)
	}
	if alias != "" {
		alias += "."
	}
	exprs := make([]string, len(eventColumns))
	for i, c := range eventColumns {
		exprs[i] = alias + c.expr
		if c.optional && !present[c.name] {
			exprs[i] = "NULL::text"
		}
	}
	return strings.Join(exprs, ", "), nil
}

// EventFromRow fills ev from the values of EventColumns' list, which v
// starts with. ev aliases v.
func EventFromRow(v [][]byte, ev *publisher.Event) {
	*ev = publisher.Event{EventID: v[0], AggregateType: v[1], AggregateID: v[2], EventType: v[3],
		SchemaVersion: v[4], Payload: v[5], Headers: v[6], OccurredAt: v[7]}
}

// EventColumnCount is how many values EventColumns' list reads.
var EventColumnCount = len(eventColumns)

// QuarantinedEvent describes an event that failed before it was sent.
func QuarantinedEvent(ev *publisher.Event, perr *publisher.Error) Quarantined {
	return Quarantined{
		EventID: string(ev.EventID), AggregateType: string(ev.AggregateType), AggregateID: string(ev.AggregateID),
		EventType: string(ev.EventType), SchemaVersion: string(ev.SchemaVersion), Payload: string(ev.Payload),
		Headers: string(ev.Headers), OccurredAt: string(ev.OccurredAt),
		Topic: perr.Topic, ErrorClass: string(perr.Class), ErrorMessage: publisher.Explain(perr),
	}
}

// QuarantinedRecord describes an event whose record Kafka rejected.
func QuarantinedRecord(r *publisher.Record, perr *publisher.Error) Quarantined {
	return Quarantined{
		EventID: r.EventID(), AggregateType: string(r.Header("aggregate_type")), AggregateID: string(r.Key()),
		EventType: string(r.Header("event_type")), SchemaVersion: string(r.Header("schema_version")),
		Payload: string(r.Value()), Headers: string(r.RowHeaders()), OccurredAt: string(r.Header("occurred_at")),
		Topic: perr.Topic, ErrorClass: string(perr.Class), ErrorMessage: publisher.Explain(perr),
	}
}
