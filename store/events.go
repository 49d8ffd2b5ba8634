package store

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/publisher"
)

// EventColumns is the SELECT list that reads an event from the outbox
// table in layout l (layout.SelectList: the text forms the replication
// stream delivers, so a record built from an SQL read is byte for byte
// what the WAL path sends), each column qualified with alias when it is
// not empty, and NULL for each optional column the table lacks, as the WAL
// path takes a missing one. publisher.EventOfColumns reads its values.
func EventColumns(ctx context.Context, conn *pgx.Conn, outbox Table, l *layout.Layout, alias string) (string, error) {
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
	quote := func(name string) string { return pgx.Identifier{name}.Sanitize() }
	if alias != "" {
		quote = func(name string) string { return pgx.Identifier{alias, name}.Sanitize() }
	}
	return l.SelectList(present, quote), nil
}

// QuarantinedEvent describes an event that failed before it was sent.
func QuarantinedEvent(ev *publisher.Event, perr *publisher.Error) Quarantined {
	q := Quarantined{
		EventID: string(ev.EventID), AggregateType: string(ev.AggregateType), AggregateID: string(ev.AggregateID),
		EventType: string(ev.EventType), SchemaVersion: string(ev.SchemaVersion), Payload: string(ev.Payload),
		Headers: string(ev.Headers), OccurredAt: string(ev.OccurredAt),
		Topic: perr.Topic, ErrorClass: string(perr.Class), ErrorMessage: publisher.Explain(perr),
	}
	if ev.Layout != nil && ev.Layout.Shape == layout.ShapeDebezium {
		q.PayloadNull = ev.Payload == nil
		q.Headers = debeziumHeaders(ev)
	}
	return q
}

// debeziumHeaders keeps the header columns of an event in the router's
// shape in the quarantine table's headers column, with the row's own
// headers if the layout reads them: a JSON object, a NULL column as null.
func debeziumHeaders(ev *publisher.Event) string {
	members := map[string]json.RawMessage{}
	if len(ev.Headers) > 0 {
		// A headers value that is no JSON object is kept out; the error
		// the event was quarantined with says what was wrong with it.
		_ = json.Unmarshal(ev.Headers, &members)
	}
	for i, name := range ev.Layout.HeaderNames() {
		value := json.RawMessage("null")
		if i < len(ev.Extra) && ev.Extra[i] != nil {
			value, _ = json.Marshal(string(ev.Extra[i]))
		}
		members[name] = value
	}
	if len(members) == 0 {
		return ""
	}
	b, _ := json.Marshal(members)
	return string(b)
}

// QuarantinedRecord describes an event whose record Kafka rejected.
func QuarantinedRecord(r *publisher.Record, perr *publisher.Error) Quarantined {
	q := Quarantined{
		EventID: r.EventID(), AggregateType: string(r.Header("aggregate_type")), AggregateID: string(r.Key()),
		EventType: string(r.Header("event_type")), SchemaVersion: string(r.Header("schema_version")),
		Payload: string(r.Value()), Headers: string(r.RowHeaders()), OccurredAt: string(r.Header("occurred_at")),
		Topic: perr.Topic, ErrorClass: string(perr.Class), ErrorMessage: publisher.Explain(perr),
	}
	if r.Debezium() {
		q.AggregateType, q.EventType = string(r.AggregateType()), string(r.EventType())
		q.SchemaVersion, q.OccurredAt = "", ""
		q.PayloadNull = r.Value() == nil
	}
	return q
}
