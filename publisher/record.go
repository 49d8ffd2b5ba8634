package publisher

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/layout"
)

// Event is one outbox row as the publisher needs it. The byte slices may alias
// a buffer the caller reuses: Build copies what the producer must keep.
type Event struct {
	EventID       []byte
	AggregateType []byte
	AggregateID   []byte
	EventType     []byte
	SchemaVersion []byte
	Payload       []byte
	Headers       []byte // a JSON object, or nil
	OccurredAt    []byte // PostgreSQL's ISO text in UTC, e.g. "2026-11-29 21:03:56.123+00"
	// Extra holds the values of Layout's header columns, in order; nil is
	// SQL NULL.
	Extra [][]byte
	// Layout says what shape of record the event makes; nil is the
	// relay's own.
	Layout *layout.Layout

	// Txn and CommitTime identify the event's transaction; they come back in
	// the acknowledgement unchanged.
	Txn        uint64
	CommitTime time.Time
}

// EventOfColumns makes the event of a row read with l.SelectList: the
// fields in layout.Field order, then the header columns. The event aliases
// values.
func EventOfColumns(l *layout.Layout, values [][]byte) Event {
	v := values[:layout.NumFields]
	ev := Event{EventID: v[layout.EventID], AggregateType: v[layout.AggregateType], AggregateID: v[layout.AggregateID],
		EventType: v[layout.EventType], SchemaVersion: v[layout.SchemaVersion], Payload: v[layout.Payload],
		Headers: v[layout.Headers], OccurredAt: v[layout.OccurredAt], Layout: l}
	if len(l.HeaderColumns) > 0 {
		ev.Extra = values[layout.NumFields:]
	}
	return ev
}

// ReservedHeaders are the headers every record carries. A row's own headers
// may not use these names.
var ReservedHeaders = []string{"event_id", "event_type", "aggregate_type", "aggregate_id", "schema_version", "occurred_at"}

var (
	headerEventID       = []byte("event_id")
	headerEventType     = []byte("event_type")
	headerAggregateType = []byte("aggregate_type")
	headerAggregateID   = []byte("aggregate_id")
	headerSchemaVersion = []byte("schema_version")
	headerOccurredAt    = []byte("occurred_at")
)

// inlineHeaders is how many headers fit in a Record without another
// allocation: the six standard ones plus a couple of the row's own.
const inlineHeaders = 8

// recordBatchOverhead is the size of a Kafka v2 record batch header. The
// broker checks max.message.bytes against whole batches, so a record alone
// in its batch needs this much room besides itself.
const recordBatchOverhead = 61

// Record is a built Kafka record, ready to send. Everything the producer
// keeps lives in this one allocation plus one byte buffer, which keeps the
// per-event cost of the hot path at two allocations.
type Record struct {
	msg     sarama.ProducerMessage
	key     bytesEncoder
	value   bytesEncoder
	headers [inlineHeaders]sarama.RecordHeader

	eventID []byte
	// debezium is set for a record in the router's shape, which carries
	// no aggregate_type or event_type header: these keep them for the
	// quarantine table.
	debezium   *debeziumSource
	txn        uint64
	commitTime time.Time
	size       int
	// built is when the exactly-once sink took the event: its Kafka
	// transaction's interval runs from its oldest record's.
	built time.Time
	// pos is the record's place in its Kafka transaction (exactly-once).
	pos int
}

// Size is the record's encoded size in bytes, as Kafka counts it.
func (r *Record) Size() int { return r.size }

// Topic is the record's topic.
func (r *Record) Topic() string { return r.msg.Topic }

// EventID is the event_id of the row the record was built from.
func (r *Record) EventID() string { return string(r.eventID) }

// Key is the record's key, the aggregate ID.
func (r *Record) Key() []byte { return r.key.b }

// Value is the record's value, the payload.
func (r *Record) Value() []byte { return r.value.b }

// Header returns the value of the named header, or nil.
func (r *Record) Header(name string) []byte {
	for _, h := range r.msg.Headers {
		if string(h.Key) == name {
			return h.Value
		}
	}
	return nil
}

// RowHeaders returns the headers that came from the row's headers column,
// and in the router's shape from the header columns too, as a JSON object,
// or nil when there are none.
func (r *Record) RowHeaders() []byte {
	first := len(ReservedHeaders)
	if r.debezium != nil {
		first = 1
	}
	extra := r.msg.Headers[first:]
	if len(extra) == 0 {
		return nil
	}
	obj := make(map[string]*string, len(extra))
	for _, h := range extra {
		if h.Value == nil {
			obj[string(h.Key)] = nil
			continue
		}
		v := string(h.Value)
		obj[string(h.Key)] = &v
	}
	b, _ := json.Marshal(obj)
	return b
}

// bytesEncoder is a sarama.Encoder whose methods have pointer receivers, so
// storing &field in msg.Key does not allocate the way a []byte conversion to
// sarama.ByteEncoder would.
type bytesEncoder struct{ b []byte }

func (e *bytesEncoder) Encode() ([]byte, error) { return e.b, nil }
func (e *bytesEncoder) Length() int             { return len(e.b) }

// BuildRecord builds an event's record for a topic the caller resolved,
// without the topic lookup and size checks of Publisher.Build, which needs
// a broker. Tests outside this package use it: the relay's fake sink, and
// outbox's check that the relay can build every row the writer writes.
func BuildRecord(ev *Event, topic string) (*Record, error) { return buildShaped(ev, topic) }

// buildShaped builds the record in the shape the event's layout asks for.
func buildShaped(ev *Event, topic string) (*Record, error) {
	if ev.Layout != nil && ev.Layout.Shape == layout.ShapeDebezium {
		return buildDebezium(ev, topic)
	}
	return build(ev, topic)
}

// Txn is the transaction the record's event belongs to, as the event said.
func (r *Record) Txn() uint64 { return r.txn }

// build fills a Record from an event and its resolved topic.
func build(ev *Event, topic string) (*Record, error) {
	n := len(ev.EventID) + len(ev.AggregateType) + len(ev.AggregateID) + len(ev.EventType) +
		len(ev.SchemaVersion) + len(ev.OccurredAt) + len(ev.Payload)
	var extraInline [inlineHeaders - 6]header
	extra, err := rowHeaders(ev.Headers, extraInline[:0])
	if err != nil {
		return nil, err
	}
	for _, h := range extra {
		n += len(h.Key) + len(h.Value)
	}

	buf := make([]byte, 0, n)
	take := func(b []byte) []byte {
		start := len(buf)
		buf = append(buf, b...)
		return buf[start:len(buf):len(buf)]
	}
	takeRFC3339 := func(pg []byte) []byte {
		start := len(buf)
		buf = appendRFC3339(buf, pg)
		return buf[start:len(buf):len(buf)]
	}
	r := &Record{txn: ev.Txn, commitTime: ev.CommitTime}
	r.eventID = take(ev.EventID)
	aggregateID := take(ev.AggregateID)
	r.key.b = aggregateID
	r.value.b = take(ev.Payload)
	headers := r.headers[:0]
	if 6+len(extra) > inlineHeaders {
		headers = make([]sarama.RecordHeader, 0, 6+len(extra))
	}
	headers = append(headers,
		sarama.RecordHeader{Key: headerEventID, Value: r.eventID},
		sarama.RecordHeader{Key: headerEventType, Value: take(ev.EventType)},
		sarama.RecordHeader{Key: headerAggregateType, Value: take(ev.AggregateType)},
		sarama.RecordHeader{Key: headerAggregateID, Value: aggregateID},
		sarama.RecordHeader{Key: headerSchemaVersion, Value: take(ev.SchemaVersion)},
		sarama.RecordHeader{Key: headerOccurredAt, Value: takeRFC3339(ev.OccurredAt)},
	)
	for _, h := range extra {
		headers = append(headers, sarama.RecordHeader{Key: take(h.Key), Value: take(h.Value)})
	}

	return r.seal(topic, headers), nil
}

// seal makes the producer message of a built record, in either shape, and
// its size.
func (r *Record) seal(topic string, headers []sarama.RecordHeader) *Record {
	r.msg = sarama.ProducerMessage{
		Topic: topic,
		// -1 until sarama picks the partition, so a record refused before
		// that is not taken for one that reached partition 0.
		Partition: -1,
		Key:       &r.key,
		Value:     &r.value,
		Headers:   headers,
		Metadata:  r,
	}
	r.size = r.msg.ByteSize(2)
	return r
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

// header is one of a row's own headers.
type header struct{ Key, Value []byte }

// rowHeaders reads the row's headers column, a JSON object, into dst:
// string values become header values as they are, other values are kept as
// JSON text, and JSON null becomes a null header value. Object order is kept.
// The result aliases raw unless a string holds escapes; a hand-written
// scanner keeps a row with headers from costing dozens of allocations.
func rowHeaders(raw []byte, dst []header) ([]header, error) {
	i := skipSpace(raw, 0)
	if i == len(raw) || string(trimSpaceRight(raw[i:])) == "null" {
		return dst, nil
	}
	if raw[i] != '{' {
		return nil, errors.New("headers column is not a JSON object")
	}
	i = skipSpace(raw, i+1)
	if i < len(raw) && raw[i] == '}' {
		if skipSpace(raw, i+1) != len(raw) {
			return nil, fmt.Errorf("headers column: malformed JSON object at offset %d", i+1)
		}
		return dst, nil
	}
	for {
		if i >= len(raw) || raw[i] != '"' {
			return nil, fmt.Errorf("headers column: expected a key at offset %d", i)
		}
		key, next, err := jsonString(raw, i)
		if err != nil {
			return nil, fmt.Errorf("headers column: %w", err)
		}
		for _, reserved := range ReservedHeaders {
			if string(key) == reserved {
				return nil, fmt.Errorf("headers column sets reserved header %q", key)
			}
		}
		i = skipSpace(raw, next)
		if i >= len(raw) || raw[i] != ':' {
			return nil, fmt.Errorf("headers column, key %q: expected ':'", key)
		}
		i = skipSpace(raw, i+1)
		var value []byte
		switch {
		case i < len(raw) && raw[i] == '"':
			value, next, err = jsonString(raw, i)
		case len(raw)-i >= 4 && string(raw[i:i+4]) == "null":
			value, next = nil, i+4
		default:
			next, err = jsonValueEnd(raw, i)
			if err == nil {
				// The value as written, without the space before the next
				// comma or brace.
				value = trimSpaceRight(raw[i:next])
			}
		}
		if err != nil {
			return nil, fmt.Errorf("headers column, key %q: %w", key, err)
		}
		dst = append(dst, header{Key: key, Value: value})
		i = skipSpace(raw, next)
		if i < len(raw) && raw[i] == ',' {
			i = skipSpace(raw, i+1)
			continue
		}
		if i < len(raw) && raw[i] == '}' && skipSpace(raw, i+1) == len(raw) {
			return dst, nil
		}
		return nil, fmt.Errorf("headers column: malformed JSON object at offset %d", i)
	}
}

func trimSpaceRight(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t' || b[len(b)-1] == '\n' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	return b
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// jsonString reads the string starting at b[i] (a quote) and returns its
// content and the offset after its closing quote. A string with escapes or
// bytes that are not UTF-8 goes through encoding/json, so both forms of the
// same text give the same header.
func jsonString(b []byte, i int) (content []byte, next int, err error) {
	slow := false
	for j := i + 1; j < len(b); j++ {
		switch c := b[j]; {
		case c == '\\':
			slow = true
			j++
		case c < 0x20:
			return nil, 0, fmt.Errorf("control character %#x in a string", c)
		case c >= utf8.RuneSelf:
			slow = true
		case c == '"':
			if !slow {
				return b[i+1 : j], j + 1, nil
			}
			var s string
			if err := json.Unmarshal(b[i:j+1], &s); err != nil {
				return nil, 0, err
			}
			return []byte(s), j + 1, nil
		}
	}
	return nil, 0, errors.New("unterminated string")
}

// jsonValueEnd returns the offset just after the number, literal, object or
// array starting at b[i].
func jsonValueEnd(b []byte, i int) (int, error) {
	depth := 0
	for j := i; j < len(b); j++ {
		switch c := b[j]; c {
		case '"':
			_, next, err := jsonString(b, j)
			if err != nil {
				return 0, err
			}
			j = next - 1
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return j, validJSON(b[i:j])
			}
			depth--
			if depth == 0 {
				return j + 1, validJSON(b[i : j+1])
			}
		case ',':
			if depth == 0 {
				return j, validJSON(b[i:j])
			}
		}
	}
	if depth == 0 {
		return len(b), validJSON(b[i:])
	}
	return 0, errors.New("unterminated value")
}

func validJSON(v []byte) error {
	if !json.Valid(v) {
		return fmt.Errorf("invalid JSON value %q", v)
	}
	return nil
}
