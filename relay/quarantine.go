package relay

import (
	"context"
	"encoding/json"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/store"
)

// Permanent-error policies, chosen by --on-permanent-error.
const (
	OnPermanentQuarantine = "quarantine"
	OnPermanentHalt       = "halt"
)

// Quarantined is one event Kafka would not accept; the store keeps it.
type Quarantined = store.Quarantined

// fromEvent describes an event that failed before it was sent.
func fromEvent(ev *publisher.Event, perr *publisher.Error) Quarantined {
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

// fromRecord describes an event whose record Kafka rejected.
func fromRecord(r *publisher.Record, perr *publisher.Error) Quarantined {
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

// eventOfQuarantined turns a quarantined row back into an event to publish
// again, in the layout's shape. The quarantine table cannot hold a NULL
// (but for the payload of Debezium's layout), so a value the row lacked
// comes back empty; replay's row check refuses it like the read loop's.
func eventOfQuarantined(e *Quarantined, l *layout.Layout) *publisher.Event {
	ev := &publisher.Event{
		EventID: []byte(e.EventID), AggregateType: []byte(e.AggregateType), AggregateID: []byte(e.AggregateID),
		EventType: []byte(e.EventType), SchemaVersion: []byte(e.SchemaVersion), Payload: []byte(e.Payload),
		OccurredAt: []byte(e.OccurredAt), Layout: l,
	}
	if e.Headers != "" {
		ev.Headers = []byte(e.Headers)
	}
	if l.Shape == layout.ShapeDebezium {
		if e.PayloadNull {
			ev.Payload = nil
		}
		ev.Extra, ev.Headers = splitDebeziumHeaders(e.Headers, l)
	}
	return ev
}

// splitDebeziumHeaders undoes debeziumHeaders: the header columns' values
// in layout order (null or absent as nil), and the other members as the
// row's headers.
func splitDebeziumHeaders(stored string, l *layout.Layout) (extra [][]byte, rest []byte) {
	members := map[string]json.RawMessage{}
	if stored != "" {
		if err := json.Unmarshal([]byte(stored), &members); err != nil {
			// Not written by the relay: replay it as the row's headers and
			// let the record builder say what is wrong.
			return make([][]byte, len(l.HeaderColumns)), []byte(stored)
		}
	}
	extra = make([][]byte, len(l.HeaderColumns))
	for i, name := range l.HeaderNames() {
		raw, ok := members[name]
		delete(members, name)
		if !ok || string(raw) == "null" {
			continue
		}
		var s string
		if json.Unmarshal(raw, &s) == nil {
			extra[i] = []byte(s)
		} else {
			extra[i] = raw
		}
	}
	if len(members) > 0 {
		rest, _ = json.Marshal(members)
	}
	return extra, rest
}

// quarantineTable is the table quarantined events go to.
func (c Config) quarantineTable() (store.Table, error) {
	return store.QuarantineTable(c.Replication.Table, c.QuarantineTable)
}

// openQuarantine opens the quarantine table for access.
func (r *Relay) openQuarantine(ctx context.Context, access store.Access) (*store.Quarantine, error) {
	table, err := r.cfg.quarantineTable()
	if err != nil {
		return nil, err
	}
	return store.OpenQuarantine(ctx, r.cfg.Replication, table, access)
}
