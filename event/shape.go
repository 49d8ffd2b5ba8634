package event

import "github.com/outbox-relay/outbox-relay/layout"

// Shape is one shape of Kafka record an outbox row can become. A new
// shape is a file with a type that implements it, and a case in ShapeOf.
type Shape interface {
	// Build makes ev's record into r: key, value and headers, copied into
	// one buffer so r does not alias ev. An error says why Kafka could
	// never take the event as it is (malformed or clashing headers).
	Build(ev *Event, r *Record) error
	// Store is ev as the quarantine table keeps it.
	Store(ev *Event) Stored
	// StoreRecord is the same of a record this shape built, which Kafka
	// refused.
	StoreRecord(r *Record) Stored
	// Restore turns a stored event back into the event to publish again;
	// l is the layout it is restored into, of this shape.
	Restore(s *Stored, l *layout.Layout) *Event
}

// Build makes ev's record into r in the shape ev's layout asks for.
func Build(ev *Event, r *Record) error {
	// A record may be reused: what the last build said of its value
	// must not carry over.
	r.layout, r.binary, r.textData = ev.Layout, false, false
	return ShapeOf(ev.Layout).Build(ev, r)
}

// ShapeOf is the shape of the records a layout's format asks for; nil is
// the relay's own.
func ShapeOf(l *layout.Layout) Shape {
	if l == nil {
		return Relay{}
	}
	switch l.RecordFormat() {
	case layout.FormatDebezium:
		return Debezium{}
	case layout.FormatCloudEvents:
		return CloudEvents{}
	case layout.FormatCloudEventsStructured:
		return CloudEvents{Structured: true}
	default:
		return Relay{}
	}
}

// Header is one record header; a nil Value is a null one.
type Header struct{ Key, Value []byte }

// inlineHeaders is how many headers fit in a Record without another
// allocation: the six standard ones plus a couple of the row's own.
const inlineHeaders = 8

// Record is a built Kafka record before a client wraps it. Its slices
// share one buffer, which does not alias the event it was built from.
type Record struct {
	EventID []byte
	Key     []byte
	// Value is the payload (in structured CloudEvents, the whole event);
	// nil is a null value.
	Value   []byte
	Headers []Header
	// AggregateType and EventType are the event's, whatever the shape
	// placed in the headers, for the quarantine table.
	AggregateType, EventType []byte

	// layout is the event's, which says the shape that built the record.
	layout *layout.Layout
	// binary says Value holds a binary payload's bytes.
	binary bool
	// textData says a structured CloudEvent carries its payload as a
	// JSON string in data (a payload that is not JSON, or a media type
	// that is not JSON's).
	textData bool
	inline   [inlineHeaders]Header
}

// Stored is the record's event as the quarantine table keeps it.
func (r *Record) Stored() Stored { return ShapeOf(r.layout).StoreRecord(r) }

// Header returns the value of the named header, or nil.
func (r *Record) Header(name string) []byte {
	for _, h := range r.Headers {
		if string(h.Key) == name {
			return h.Value
		}
	}
	return nil
}

// headers gives Build room for n headers: the record's own inline array
// when they fit, so most records cost no allocation for them.
func (r *Record) headers(n int) []Header {
	if n > inlineHeaders {
		return make([]Header, 0, n)
	}
	return r.inline[:0]
}

// arena is the one buffer a record's values are copied into.
type arena struct{ buf []byte }

// take copies b into the arena. Even a nil b comes back as an empty,
// non-nil value: in the relay's shape a NULL column is an empty header.
func (a *arena) take(b []byte) []byte {
	start := len(a.buf)
	a.buf = append(a.buf, b...)
	return a.buf[start:len(a.buf):len(a.buf)]
}

// takeNullable is take where nil stays nil, so a NULL stays a null.
func (a *arena) takeNullable(b []byte) []byte {
	if b == nil {
		return nil
	}
	start := len(a.buf)
	a.buf = append(a.buf, b...)
	return a.buf[start:len(a.buf):len(a.buf)]
}

// payload copies ev's payload into the arena as the record's value: a
// binary one decoded to its bytes. A nil payload stays nil when nullable,
// else becomes an empty value.
func (a *arena) payload(ev *Event, r *Record, nullable bool) ([]byte, error) {
	r.binary = ev.PayloadBinary && ev.Payload != nil
	switch {
	case ev.Payload == nil && nullable:
		return nil, nil
	case r.binary:
		return a.takeBytea(ev.Payload)
	}
	return a.take(ev.Payload), nil
}

// storedPayload is a record's value as the quarantine table keeps it:
// a binary one in bytea's text form, which Restore gives back as it is.
func (r *Record) storedPayload(s *Stored, value []byte) {
	s.Payload, s.PayloadNull, s.PayloadBinary = string(value), value == nil, r.binary
	if r.binary {
		s.Payload = byteaText(value)
	}
}

// takeRFC3339 copies PostgreSQL's timestamptz text in as RFC 3339.
func (a *arena) takeRFC3339(pg []byte) []byte {
	start := len(a.buf)
	a.buf = appendRFC3339(a.buf, pg)
	return a.buf[start:len(a.buf):len(a.buf)]
}

// appendRFC3339 appends PostgreSQL's ISO timestamptz text in UTC
// ("2026-11-29 21:03:56.123456+00") as RFC 3339 ("2026-11-29T21:03:56.123456Z"),
// without parsing it. Anything else (infinity, a far year) passes unchanged,
// because the header should show the row's value rather than fail the line.
func appendRFC3339(dst, pg []byte) []byte {
	n := len(pg)
	if n < 22 || pg[10] != ' ' || pg[n-3] != '+' || pg[n-2] != '0' || pg[n-1] != '0' {
		return append(dst, pg...)
	}
	dst = append(dst, pg[:10]...)
	dst = append(dst, 'T')
	dst = append(dst, pg[11:n-3]...)
	return append(dst, 'Z')
}
