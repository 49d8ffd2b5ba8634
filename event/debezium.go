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
// with the event id, then content-type if --content-type sets one and the
// row's headers do not, then one header per header column, null for a NULL
// column, then the row's headers column if the layout reads one. None of
// the relay's standard headers.
type Debezium struct{}

// headerID is the router's header that carries the event id.
var headerID = []byte("id")

// Build implements Shape.
func (Debezium) Build(ev *Event, r *Record) error {
	var extraInline [inlineHeaders]Header
	names, extra, n, err := placedHeaders(ev, extraInline[:0], func(key []byte) error {
		if string(key) == string(headerID) {
			return errors.New(`headers column sets header "id", which carries the event id`)
		}
		return nil
	})
	if err != nil {
		return err
	}
	contentType, err := configuredContentType(ev, extra)
	if err != nil {
		return err
	}
	n += len(ev.EventID) + len(ev.AggregateType) + len(ev.AggregateID) + len(ev.EventType) + len(ev.Payload) + len(contentType)

	a := arena{buf: make([]byte, 0, n)}
	r.EventID = a.takeNullable(ev.EventID)
	r.Key = a.takeNullable(ev.AggregateID)
	if r.Value, err = a.payload(ev, r, true); err != nil {
		return err
	}
	r.AggregateType = a.takeNullable(ev.AggregateType)
	r.EventType = a.takeNullable(ev.EventType)
	headers := append(r.headers(plusContentType(1, contentType)+len(names)+len(extra)), Header{Key: headerID, Value: r.EventID})
	if contentType != nil {
		// Copied: a row's value aliases the caller's buffer.
		headers = append(headers, Header{Key: headerContentType, Value: a.take(contentType)})
	}
	r.Headers = a.appendPlaced(headers, ev, names, extra)
	return nil
}

// placedHeaders reads what a shape with header columns places after its
// own headers: the layout's header columns' names, and the row's headers
// column into dst, refusing a row header that a header column fills or
// that clash says is the shape's own. size is the bytes both hold.
func placedHeaders(ev *Event, dst []Header, clash func(key []byte) error) (names [][]byte, extra []Header, size int, err error) {
	names = ev.Layout.HeaderKeys()
	if len(ev.Extra) != len(names) {
		return nil, nil, 0, fmt.Errorf("event has %d header column values, the layout %d", len(ev.Extra), len(names))
	}
	for i, name := range names {
		size += len(name) + len(ev.Extra[i])
	}
	if extra, err = rowHeaders(ev.Headers, dst); err != nil {
		return nil, nil, 0, err
	}
	for _, h := range extra {
		if err := clash(h.Key); err != nil {
			return nil, nil, 0, err
		}
		for _, name := range names {
			if string(h.Key) == string(name) {
				return nil, nil, 0, fmt.Errorf("headers column sets header %q, which a header column fills", name)
			}
		}
		size += len(h.Key) + len(h.Value)
	}
	return names, extra, size, nil
}

// appendPlaced appends the header columns' values, then the row's
// headers, copied into the arena; a NULL column stays a null value.
func (a *arena) appendPlaced(headers []Header, ev *Event, names [][]byte, extra []Header) []Header {
	for i, name := range names {
		headers = append(headers, Header{Key: name, Value: a.takeNullable(ev.Extra[i])})
	}
	for _, h := range extra {
		headers = append(headers, Header{Key: a.takeNullable(h.Key), Value: a.takeNullable(h.Value)})
	}
	return headers
}

// Store implements Shape. The header columns' values go into the stored
// headers, with the row's own headers if the layout reads them.
func (Debezium) Store(ev *Event) Stored {
	s := Relay{}.Store(ev)
	s.PayloadNull, s.Headers = ev.Payload == nil, storedWithContentType(debeziumHeaders(ev), ev.ContentType)
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
	s := Stored{
		EventID: string(r.EventID), AggregateType: string(r.AggregateType), AggregateID: string(r.Key),
		EventType: string(r.EventType), Headers: string(headersObject(r.ownHeaders(1))),
	}
	r.storedPayload(&s, r.Value)
	return s
}

// Restore implements Shape.
func (Debezium) Restore(s *Stored, l *layout.Layout) *Event {
	ev := &Event{
		EventID: []byte(s.EventID), AggregateType: []byte(s.AggregateType), AggregateID: []byte(s.AggregateID),
		EventType: []byte(s.EventType), SchemaVersion: []byte(s.SchemaVersion), Payload: []byte(s.Payload),
		PayloadBinary: s.PayloadBinary, OccurredAt: []byte(s.OccurredAt), Layout: l,
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
