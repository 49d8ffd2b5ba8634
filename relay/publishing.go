package relay

import "github.com/outbox-relay/outbox-relay/publisher"

// QuarantinedEvent describes an event that failed before it was sent, the
// way the read loop stores it, for other commands that publish outbox rows
// (reconcile --republish).
func QuarantinedEvent(ev *publisher.Event, perr *publisher.Error) Quarantined {
	return fromEvent(ev, perr)
}

// QuarantinedRecord describes an event whose record Kafka rejected, the way
// the producer's outcome handler stores it.
func QuarantinedRecord(r *publisher.Record, perr *publisher.Error) Quarantined {
	return fromRecord(r, perr)
}
