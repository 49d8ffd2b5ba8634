package replication

import "fmt"

// Messages reports whether this is the messages source's stream.
func (c Config) Messages() bool { return c.MessagePrefix != "" }

// MessagesGapAdvice is what to do about messages committed while no slot
// held them (from since on), for the messages source. The table source
// finds such events in the outbox table with reconcile; a message exists
// only in the WAL, so once its slot is gone nothing in the database can
// give it back, and advice naming reconcile (refused in this mode) would
// send the operator nowhere.
func MessagesGapAdvice(since string) string {
	return fmt.Sprintf("the events of that gap (committed since %s) were logical decoding messages, which exist only in the WAL: no table holds them, and reconcile cannot find them. "+
		"To deliver them, the services that emitted them must emit them again from their own records, or restore a backup taken before the gap and have them re-emitted from it; consumers dedupe a re-emitted event by its event_id", since)
}

// lostSlotAdvice completes the error of a slot PostgreSQL invalidated.
func (c Config) lostSlotAdvice(slot string) string {
	if c.Messages() {
		return fmt.Sprintf("drop the slot (SELECT pg_drop_replication_slot('%s')) and start the relay with --recreate-lost-slot, or run `outbox-relay migrate --source messages`; %s",
			slot, MessagesGapAdvice("the last event Kafka holds"))
	}
	return fmt.Sprintf("Reconcile the outbox table against Kafka for that period, then drop the slot (SELECT pg_drop_replication_slot('%s')) and start the relay with --recreate-lost-slot, or run migrate", slot)
}
