package inbox

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/outbox-relay/outbox-relay/outbox"
)

// Header is one Kafka record header, as any client hands it over.
type Header struct {
	Key, Value []byte
}

// Event is one record from the relay, as the inbox and a handler see it.
type Event struct {
	ID            string // the event_id header
	AggregateType string
	AggregateID   string
	EventType     string
	// Version is the aggregate_version header; 0 when the record has none.
	Version int64
	// Payload is the record's value: JSON, text, or the bytes of a bytea
	// payload (Protobuf, Avro) as they were written, never re-encoded.
	Payload []byte
	// Headers holds every header of the record, the relay's own included;
	// content-type, when the writer or the relay's --content-type set one,
	// says how to read a binary Payload.
	Headers map[string]string
}

// VersionHeader is the header the writer (package outbox) puts the
// aggregate's version in.
const VersionHeader = outbox.VersionHeader

// ErrNoEventID means a record lacks the event_id header: it did not come
// from the relay, and the inbox cannot tell a re-delivery of it.
var ErrNoEventID = errors.New("record has no event_id header")

// Parse reads a relay record's headers and value into an Event. Any Kafka
// client works: pass its headers as Header values.
func Parse(headers []Header, value []byte) (Event, error) {
	ev := Event{Payload: value, Headers: make(map[string]string, len(headers))}
	for _, h := range headers {
		ev.Headers[string(h.Key)] = string(h.Value)
	}
	ev.ID = ev.Headers["event_id"]
	ev.AggregateType = ev.Headers["aggregate_type"]
	ev.AggregateID = ev.Headers["aggregate_id"]
	ev.EventType = ev.Headers["event_type"]
	if ev.ID == "" {
		return Event{}, ErrNoEventID
	}
	if v, ok := ev.Headers[VersionHeader]; ok {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 {
			return Event{}, fmt.Errorf("event %s: header %s is %q, want a positive integer", ev.ID, VersionHeader, v)
		}
		ev.Version = n
	}
	return ev, nil
}
