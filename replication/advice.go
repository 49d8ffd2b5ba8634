package replication

import "fmt"

// lostSlotAdvice completes the error of a slot PostgreSQL invalidated.
func (c Config) lostSlotAdvice(slot string) string {
	if !c.ReadsTable() {
		return fmt.Sprintf("drop the slot (SELECT pg_drop_replication_slot('%s')) and start the relay with --recreate-lost-slot, or run `%s`; %s",
			slot, c.source().Migrate(), c.GapAdvice("the last event Kafka holds"))
	}
	return fmt.Sprintf("Reconcile the outbox table against Kafka for that period, then drop the slot (SELECT pg_drop_replication_slot('%s')) and start the relay with --recreate-lost-slot, or run migrate; "+
		"or start the relay with --on-slot-lost recover, which does all of that by itself (see docs/slot-trouble.md)", slot)
}
