// Package event is the outbox event and the record shapes it becomes: an
// Event is one outbox row as the relay reads it (from the WAL, a poll or
// an SQL read), and a Shape turns it into a Kafka record's key, value and
// headers, and into the text the quarantine table keeps of it and back.
// The relay's own shape, Debezium's Outbox Event Router shape and the
// CloudEvents shape each live in a file of their own; ShapeOf picks one by
// the layout's record format. No Kafka client
// is imported here: the publisher wraps a built Record for its client.
package event

import (
	"time"

	"github.com/outbox-relay/outbox-relay/layout"
)

// Event is one outbox row as the relay needs it. The byte slices may
// alias a buffer the caller reuses: a Shape's Build copies what the
// record must keep.
type Event struct {
	EventID       []byte
	AggregateType []byte
	AggregateID   []byte
	EventType     []byte
	SchemaVersion []byte
	Payload       []byte
	// PayloadBinary says Payload is a bytea column's text form, which
	// the record carries as the bytes it stands for.
	PayloadBinary bool
	// Redelivery says the source knows it may have published the event
	// before (poll mode: a row claimed again after its lease expired); the
	// relay's trace span says so.
	Redelivery bool
	Headers    []byte // a JSON object, or nil
	OccurredAt []byte // PostgreSQL's ISO text in UTC, e.g. "2026-11-29 21:03:56.123+00"
	// ContentType is the row's --column-content-type value: the payload's
	// media type, which wins over --content-type; nil or empty for none.
	ContentType []byte
	// Extra holds the values of Layout's header columns, in order; nil is
	// SQL NULL.
	Extra [][]byte
	// Layout says what shape of record the event makes; nil is the
	// relay's own.
	Layout *layout.Layout

	// Txn and CommitTime identify the event's source transaction; they
	// come back in the acknowledgement unchanged.
	Txn        uint64
	CommitTime time.Time
	// Position is where the source found the event, for its trace span:
	// the row's or message's WAL position (an LSN), or in poll mode the
	// row's seq.
	Position uint64
}

// OfColumns makes the event of a row read with l.SelectList: the fields
// in layout.Field order, then the header columns. The event aliases
// values.
func OfColumns(l *layout.Layout, values [][]byte) Event {
	v := values[:layout.NumFields]
	ev := Event{EventID: v[layout.EventID], AggregateType: v[layout.AggregateType], AggregateID: v[layout.AggregateID],
		EventType: v[layout.EventType], SchemaVersion: v[layout.SchemaVersion], Payload: v[layout.Payload],
		Headers: v[layout.Headers], OccurredAt: v[layout.OccurredAt], ContentType: v[layout.ContentType], Layout: l}
	if len(l.HeaderColumns) > 0 {
		ev.Extra = values[layout.NumFields:]
	}
	return ev
}

// Stored is the event as the quarantine table keeps it: PostgreSQL's text
// forms, each shape's extra values folded into Headers. The table cannot
// hold a NULL but for the payload, so a value the row lacked is empty.
type Stored struct {
	EventID       string `json:"event_id"`
	AggregateType string `json:"aggregate_type"`
	AggregateID   string `json:"aggregate_id"`
	EventType     string `json:"event_type"`
	SchemaVersion string `json:"schema_version"`
	Payload       string `json:"payload"`
	// PayloadNull is a SQL NULL payload, which Debezium's layout publishes
	// as a null value; Payload is then empty.
	PayloadNull bool `json:"payload_null,omitempty"`
	// PayloadBinary is a binary payload, which Payload holds in bytea's
	// hex text form (\x and two hex digits a byte), so that it stays
	// text wherever the stored event goes.
	PayloadBinary bool   `json:"payload_binary,omitempty"`
	Headers       string `json:"headers,omitempty"`     // may be empty
	OccurredAt    string `json:"occurred_at,omitempty"` // may be empty
}

// Stored is ev as the quarantine table keeps it, for an event that failed
// before its record was built.
func (ev *Event) Stored() Stored { return ShapeOf(ev.Layout).Store(ev) }

// Restore turns a stored event back into the event to publish again, in
// layout l's shape.
func Restore(s *Stored, l *layout.Layout) *Event { return ShapeOf(l).Restore(s, l) }
