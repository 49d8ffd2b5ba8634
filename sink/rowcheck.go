package sink

import (
	"errors"
	"fmt"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
)

// ErrUnmappedRow marks a row written while the outbox table lacked a
// column every record needs. The caller quarantines or halts on it like
// any row CheckRow refuses.
var ErrUnmappedRow = errors.New("row cannot be published")

// unmappedAdvice is what the operator does about an unmapped row: the row
// is still in the outbox table, so the quarantine row can be filled from it.
const unmappedAdvice = "PostgreSQL decodes this row with the columns of its time, so no ALTER TABLE lets the stream pass it: it goes to the quarantine table (under --on-permanent-error halt, start once with --on-permanent-error quarantine to set it aside). " +
	"The row is still in the outbox table: fill the missing values in the quarantine table from it (UPDATE ... FROM the outbox table, by event_id), then run `outbox-relay quarantine replay`"

// UnmappedRow is the error of such a row, with the reason the decoder gave
// and the row's WAL position.
func UnmappedRow(ev *event.Event, reason string, at fmt.Stringer) *Error {
	return &Error{Class: ClassPermanent, EventID: string(ev.EventID), Topic: "(not resolved)", Partition: -1,
		Err: AdvisedError(fmt.Errorf("%w: %s; the row is at WAL position %s", ErrUnmappedRow, reason, at), unmappedAdvice)}
}

// ErrBadContent marks a logical decoding message whose content is no
// outbox event (the messages source). The caller quarantines or halts on it
// like any row CheckRow refuses.
var ErrBadContent = errors.New("message cannot be published")

// badContentAdvice is what the operator does about a message that is no
// event: it exists only in the WAL, so the quarantine row is its only copy.
const badContentAdvice = "a message exists only in the WAL, so the quarantine table's row is its only copy (raw holds the content as it was emitted; under --on-permanent-error halt, start once with --on-permanent-error quarantine to set it aside). " +
	"Fix the writer that emitted it; to deliver this event, set the row's columns from raw and clear content_problem (UPDATE on the quarantine table, by event_id), then run `outbox-relay quarantine replay`"

// withAdvice is an error that carries what to do about it.
type withAdvice struct {
	err    error
	advice string
}

func (e withAdvice) Error() string  { return e.err.Error() }
func (e withAdvice) Unwrap() error  { return e.err }
func (e withAdvice) Advice() string { return e.advice }

// AdvisedError is err with advice, for Error.Advice (and Explain) to give.
func AdvisedError(err error, advice string) error { return withAdvice{err: err, advice: advice} }

// BadContent is the error of such a message, with the reason the decoder
// gave and the message's WAL position.
func BadContent(ev *event.Event, reason string, at fmt.Stringer) *Error {
	return &Error{Class: ClassPermanent, EventID: string(ev.EventID), Topic: "(not resolved)", Partition: -1,
		Err: AdvisedError(fmt.Errorf("%w: %s; the message is at WAL position %s", ErrBadContent, reason, at), badContentAdvice)}
}

// CheckRow refuses an event that lacks a value every record needs: the
// key (aggregate_id), the values topics and headers are made of
// (aggregate_type, event_type), or the payload. The read loop and
// quarantine replay both call it, so a replayed event meets the same rules
// as a streamed one. An empty identity value is refused like a NULL one:
// the quarantine table stores a NULL as empty, and an empty key would put
// the event in the wrong order group.
//
// In Debezium's layout the event type and the payload may be NULL: the
// router places the type nowhere, and sends a NULL payload as a null value.
func CheckRow(ev *event.Event) *Error {
	l := ev.Layout
	if l == nil {
		l = layout.Relay
	}
	for _, col := range [...]struct {
		field    layout.Field
		value    []byte
		nonEmpty bool
		optional bool
	}{
		{layout.AggregateID, ev.AggregateID, true, false},
		{layout.AggregateType, ev.AggregateType, true, false},
		{layout.EventType, ev.EventType, true, !l.EventTypeRequired()},
		{layout.Payload, ev.Payload, false, l.PayloadNullable()},
	} {
		if col.optional {
			continue
		}
		if col.value == nil || col.nonEmpty && len(col.value) == 0 {
			// The topic is not named: it may be derived from the missing value.
			return &Error{Class: ClassPermanent, EventID: string(ev.EventID), Topic: "(not resolved)", Partition: -1,
				Err: fmt.Errorf("row has NULL or empty %s; the outbox table's columns must be NOT NULL and set (see migrate)", l.Column(col.field))}
		}
	}
	return nil
}
