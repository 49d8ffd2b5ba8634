package relay

import (
	"errors"
	"fmt"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/replication"
)

// ErrProgressAhead marks a progress record the server cannot be behind of
// without having lost WAL that Kafka already holds: a restored base backup,
// a point-in-time recovery, or a server on a branch the record never saw.
// Starting from the record would skip events Kafka does not have, and
// starting from the slot would ignore what the operator must decide, so the
// relay stops; --reset-progress starts from the slot once.
var ErrProgressAhead = errors.New("progress record is ahead of this server")

// Where a session's start position came from.
const (
	StartFromSlot     = "slot"
	StartFromProgress = "progress"
)

// startDecision is where a session starts streaming, and why.
type startDecision struct {
	Start  lsn.LSN
	Source string // StartFromSlot or StartFromProgress
	// Ignored says why a record that exists was not used; empty otherwise.
	Ignored string
	// When the record's timeline is an ancestor of the server's, events
	// the old primary published in (OrphanFrom, OrphanTo] may be in Kafka
	// without existing on this server. Both are zero when nothing can be.
	OrphanFrom, OrphanTo lsn.LSN
	// When the slot was created just now after the position Kafka holds
	// (a failover to a server the slot was not synced to, or a dropped
	// slot), events committed in (GapFrom, GapTo] were never streamed by
	// this slot and may never reach Kafka. Both are zero otherwise.
	GapFrom, GapTo lsn.LSN
}

// decideStart picks the start position: the later of the slot's confirmed
// position and the progress record, where the record counts only as far as
// this server's WAL is the WAL it describes. rec is nil when no record
// exists for this slot and cluster (the key holds the system identifier, so
// another cluster's record never gets here). reset ignores the record.
// slotCreated says this start created the slot, so it streams nothing
// before the slot's position. The server skips transactions that committed before the start, so a
// start never before what Kafka holds re-delivers nothing twice, and a
// start never after it loses nothing.
func decideStart(slot lsn.LSN, slotCreated bool, rec *progress.Record, sys replication.System, reset bool) (startDecision, error) {
	fromSlot := startDecision{Start: slot, Source: StartFromSlot}
	if rec == nil {
		return fromSlot, nil
	}
	if reset {
		fromSlot.Ignored = fmt.Sprintf("--reset-progress: ignoring the progress record at %s on timeline %d", rec.LSN, rec.Timeline)
		return fromSlot, nil
	}
	branch, unbounded, ok := sys.BranchPoint(rec.Timeline)
	if !ok {
		return startDecision{}, fmt.Errorf("%w: the record is on timeline %d, which is not in the history of this server (timeline %d): it comes from a server this one did not descend from (an old primary kept running after a failover, or a restore onto an older branch). Check that --pg-dsn points at the current primary; if it does, start once with --reset-progress to start from the slot (events Kafka got from the other branch stay there)",
			ErrProgressAhead, rec.Timeline, sys.Timeline)
	}
	usable := rec.LSN
	d := startDecision{}
	if !unbounded && rec.LSN > branch {
		// The old primary went on past the point this server branched off:
		// what it wrote there is not this server's WAL.
		usable = branch
		d.OrphanFrom, d.OrphanTo = branch, rec.LSN
	}
	if usable > sys.Flush {
		return startDecision{}, fmt.Errorf("%w: Kafka holds events up to %s (timeline %d) but this server's WAL ends at %s (timeline %d): it was restored from a backup or recovered to an earlier point, and events committed after that point are in Kafka but not in this database. Reconcile if needed, then start once with --reset-progress to stream from the slot's position (%s)",
			ErrProgressAhead, usable, rec.Timeline, sys.Flush, sys.Timeline, slot)
	}
	if usable > slot {
		d.Start, d.Source = usable, StartFromProgress
	} else {
		d.Start, d.Source = slot, StartFromSlot
	}
	if slotCreated && usable < slot {
		d.GapFrom, d.GapTo = usable, slot
	}
	return d, nil
}
