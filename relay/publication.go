package relay

import (
	"fmt"
	"time"
)

// publicationGoneError completes replication.ErrPublicationGone with the
// only way past it: a new slot from now, and reconcile for the events
// committed between what Kafka holds and that slot, with the time filled
// in when the relay knows it.
func (r *Relay) publicationGoneError(err error) error {
	since := "<commit time of the last event Kafka holds, less an hour>"
	if t := r.lastKnownCommit(); !t.IsZero() {
		// A transaction open across that commit has an earlier created_at,
		// which is what reconcile's window is on.
		since = t.Add(-r.cfg.Retention.Margin).UTC().Truncate(time.Second).Format(time.RFC3339)
	}
	slot := r.cfg.Replication.Slot
	if !r.cfg.Replication.ReadsTable() {
		return fmt.Errorf("%w. PostgreSQL decodes each change with the catalog of its time, so slot %q can never pass the changes written while publication %q was missing, even once the publication exists again; the relay will not drop the slot by itself. "+
			"The way out: stop every relay of this slot; drop it with SELECT pg_drop_replication_slot('%s'); run `outbox-relay migrate --source messages` (it creates the publication if missing, and a new slot from now); start the relay. %s",
			err, slot, r.cfg.Replication.Publication, slot, r.cfg.Replication.GapAdvice(since))
	}
	return fmt.Errorf("%w. PostgreSQL decodes each change with the catalog of its time, so slot %q can never pass the changes written while publication %q was missing, even once the publication exists again; the relay will not drop the slot by itself. "+
		"The way out: stop every relay of this slot; drop it with SELECT pg_drop_replication_slot('%s'); run `outbox-relay migrate --skip-slot` (it creates the publication if missing); "+
		"start the relay once with --on-slot-lost recover: it makes a new slot and, before it streams, republishes from the outbox table every event committed since %s that Kafka lacks (if it refuses, it names the next choice)",
		err, slot, r.cfg.Replication.Publication, slot, since)
}

// lastKnownCommit is the newest commit time known to be in Kafka: what
// this process confirmed, or the progress record it started from.
func (r *Relay) lastKnownCommit() time.Time {
	return later(r.confirmedCommitTime(), r.progress.lastCommit())
}
