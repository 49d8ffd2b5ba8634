package publisher

import (
	"errors"
	"fmt"

	"github.com/IBM/sarama"
)

// debeziumSource keeps what a record in the router's shape leaves out, for
// the quarantine table.
type debeziumSource struct {
	aggregateType, eventType []byte
}

// headerID is the router's header that carries the event id.
var headerID = []byte("id")

// buildDebezium builds the record Debezium's Outbox Event Router makes with
// its defaults (measured with Debezium 3.6.1, pgoutput, StringConverter for
// keys and values): key the aggregate id, value the payload as PostgreSQL's
// text, a null value for a SQL NULL payload; the header "id" with the event
// id, then one header per header column, null for a NULL column, then the
// row's headers column if the layout reads one. None of the relay's
// standard headers.
func buildDebezium(ev *Event, topic string) (*Record, error) {
	names := ev.Layout.HeaderKeys()
	if len(ev.Extra) != len(names) {
		return nil, fmt.Errorf("event has %d header column values, the layout %d", len(ev.Extra), len(names))
	}
	n := len(ev.EventID) + len(ev.AggregateType) + len(ev.AggregateID) + len(ev.EventType) + len(ev.Payload)
	for i, name := range names {
		n += len(name) + len(ev.Extra[i])
	}
	var extraInline [inlineHeaders]header
	extra, err := rowHeaders(ev.Headers, extraInline[:0])
	if err != nil {
		return nil, err
	}
	for _, h := range extra {
		if string(h.Key) == string(headerID) {
			return nil, errors.New(`headers column sets header "id", which carries the event id`)
		}
		for _, name := range names {
			if string(h.Key) == string(name) {
				return nil, fmt.Errorf("headers column sets header %q, which a header column fills", name)
			}
		}
		n += len(h.Key) + len(h.Value)
	}

	buf := make([]byte, 0, n)
	// take copies b into buf; nil stays nil, so a NULL stays a null.
	take := func(b []byte) []byte {
		if b == nil {
			return nil
		}
		start := len(buf)
		buf = append(buf, b...)
		return buf[start:len(buf):len(buf)]
	}
	r := &Record{txn: ev.Txn, commitTime: ev.CommitTime, debezium: &debeziumSource{}}
	r.eventID = take(ev.EventID)
	r.key.b = take(ev.AggregateID)
	r.value.b = take(ev.Payload)
	r.debezium.aggregateType = take(ev.AggregateType)
	r.debezium.eventType = take(ev.EventType)
	headers := r.headers[:0]
	if count := 1 + len(names) + len(extra); count > inlineHeaders {
		headers = make([]sarama.RecordHeader, 0, count)
	}
	headers = append(headers, sarama.RecordHeader{Key: headerID, Value: r.eventID})
	for i, name := range names {
		headers = append(headers, sarama.RecordHeader{Key: name, Value: take(ev.Extra[i])})
	}
	for _, h := range extra {
		headers = append(headers, sarama.RecordHeader{Key: take(h.Key), Value: take(h.Value)})
	}
	return r.seal(topic, headers), nil
}

// Debezium reports whether the record is in the router's shape.
func (r *Record) Debezium() bool { return r.debezium != nil }

// AggregateType is the event's aggregate type, whatever the shape.
func (r *Record) AggregateType() []byte {
	if r.debezium != nil {
		return r.debezium.aggregateType
	}
	return r.Header("aggregate_type")
}

// EventType is the event's type, whatever the shape.
func (r *Record) EventType() []byte {
	if r.debezium != nil {
		return r.debezium.eventType
	}
	return r.Header("event_type")
}
