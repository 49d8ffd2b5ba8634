package relay

import (
	"fmt"

	"github.com/outbox-relay/outbox-relay/publisher"
)

// CheckRequired fails with a permanent error when a row lacks a value its
// record needs. Every path that publishes outbox rows checks it before
// publisher.Build, so a bad row is quarantined the same way everywhere.
func CheckRequired(ev *publisher.Event) error {
	for _, col := range []struct {
		name  string
		value []byte
	}{{"aggregate_id", ev.AggregateID}, {"aggregate_type", ev.AggregateType}, {"event_type", ev.EventType}, {"payload", ev.Payload}} {
		if col.value == nil {
			return &publisher.Error{Class: publisher.ClassPermanent, EventID: string(ev.EventID), Partition: -1,
				Err: fmt.Errorf("row has NULL %s; the outbox table's columns must be NOT NULL (see migrate)", col.name)}
		}
	}
	return nil
}

// QuarantinedEvent describes an event that failed before it was sent, the
// way the read loop stores it, for other commands that publish outbox rows
// (reconcile --republish).
func QuarantinedEvent(ev *publisher.Event, perr *publisher.Error) Quarantined {
	q := fromEvent(ev, perr)
	if q.Payload == "" {
		q.Payload = "null"
	}
	return q
}

// QuarantinedRecord describes an event whose record Kafka rejected, the way
// the producer's outcome handler stores it.
func QuarantinedRecord(r *publisher.Record, perr *publisher.Error) Quarantined {
	return fromRecord(r, perr)
}
