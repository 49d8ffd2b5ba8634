package replication

import "fmt"

// lostSlotAdvice completes the error of a slot PostgreSQL invalidated.
func (c Config) lostSlotAdvice(slot string) string {
	if !c.ReadsTable() {
		return fmt.Sprintf("drop the slot (SELECT pg_drop_replication_slot('%s')) and start the relay with --recreate-lost-slot, or run `%s`; %s",
			slot, c.source().Migrate(), c.GapAdvice("the last event Kafka holds"))
	}
	return fmt.Sprintf("Start the relay once with --on-slot-lost recover (the gap from the progress record) or --existing-rows pending (the whole table): each drops slot %s, makes a new one and republishes from the outbox table what Kafka lacks before it streams, with the writers running. "+
		"--recreate-lost-slot gives the gap up instead (see docs/slot-trouble.md)", slot)
}
