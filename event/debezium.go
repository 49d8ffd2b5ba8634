package event

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/outbox-relay/outbox-relay/layout"
)

// Debezium is the shape of Debezium's Outbox Event Router with its
// defaults (measured with Debezium 3.6.1, pgoutput, StringConverter for
// keys and values): key the aggregate id, value the payload as
// PostgreSQL's text, a null value for a SQL NULL payload; the header "id"
// with the event id, then one header per header column, null for a NULL
// column, then the row's headers column if the layout reads one. None of
// the relay's standard headers.
type Debezium struct{}

// headerID is the router's header that carries the event id.
var headerID = []byte("id")

// Build implements Shape.
func (Debezium) Build(ev *Event, r *Record) error {
	names := ev.Layout.HeaderKeys()
	if len(ev.Extra) != len(names) {
		return fmt.Errorf("event has %d header column values, the layout %d", len(ev.Extra), len(names))
	}
	n := len(ev.EventID) + len(ev.AggregateType) + len(ev.AggregateID) + len(ev.EventType) + len(ev.Payload)
	for i, name := range names {
		n += len(name) + len(ev.Extra[i])
	}
	var extraInline [inlineHeaders]Header
	extra, err := rowHeaders(ev.Headers, extraInline[:0])
	if err != nil {
		return err
	}
	for _, h := range extra {
		if string(h.Key) == string(headerID) {
			return errors.New(`headers column sets header "id", which carries the event id`)
		}
		for _, name := range names {
			if string(h.Key) == string(name) {
				return fmt.Errorf("headers column sets header %q, which a header column fills", name)
			}
		}
		n += len(h.Key) + len(h.Value)
	}

	a := arena{buf: make([]byte, 0, n)}
	r.EventID = a.takeNullable(ev.EventID)
	r.Key = a.takeNullable(ev.AggregateID)
	r.Value = a.takeNullable(ev.Payload)
	r.AggregateType = a.takeNullable(ev.AggregateType)
	r.EventType = a.takeNullable(ev.EventType)
	headers := append(r.headers(1+len(names)+len(extra)), Header{Key: headerID, Value: r.EventID})
	for i, name := range names {
		headers = append(headers, Header{Key: name, Value: a.takeNullable(ev.Extra[i])})
	}
	for _, h := range extra {
		headers = append(headers, Header{Key: a.takeNullable(h.Key), Value: a.takeNullable(h.Value)})
	}
	r.Headers = headers
	return nil
}

// Store implements Shape. The header columns' values go into the stored
// headers, with the row's own headers if the layout reads them.
func (Debezium) Store(ev *Event) Stored {
	s := Relay{}.Store(ev)
	s.PayloadNull, s.Headers = ev.Payload == nil, debeziumHeaders(ev)
	return s
}

// debeziumHeaders keeps the header columns of an event in the router's
// shape in the stored headers, with the row's own headers if the layout
// reads them: a JSON object, a NULL column as null.
func debeziumHeaders(ev *Event) string {
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

// StoreRecord implements Shape. The record carries no schema version or
// occurred_at, so none is stored.
func (Debezium) StoreRecord(r *Record) Stored {
	return Stored{
		EventID: string(r.EventID), AggregateType: string(r.AggregateType), AggregateID: string(r.Key),
		EventType: string(r.EventType), Payload: string(r.Value), PayloadNull: r.Value == nil,
		Headers: string(headersObject(r.Headers[1:])),
	}
}

// Restore implements Shape.
func (Debezium) Restore(s *Stored, l *layout.Layout) *Event {
	ev := &Event{
		EventID: []byte(s.EventID), AggregateType: []byte(s.AggregateType), AggregateID: []byte(s.AggregateID),
		EventType: []byte(s.EventType), SchemaVersion: []byte(s.SchemaVersion), Payload: []byte(s.Payload),
		OccurredAt: []byte(s.OccurredAt), Layout: l,
	}
	if s.PayloadNull {
		ev.Payload = nil
	}
	ev.Extra, ev.Headers = splitDebeziumHeaders(s.Headers, l)
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
