package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/replication"
)

// What a session does when the slot is gone (--on-slot-lost).
const (
	// SlotLostStop stops the relay and tells the operator what to run.
	SlotLostStop = "stop"
	// SlotLostRecover makes a new slot and republishes, from the outbox
	// table, what the lost one never streamed.
	SlotLostRecover = "recover"
)

// ErrSlotUnrecoverable marks a lost slot whose gap the outbox table cannot
// cover: retrying cannot fix it, the operator must.
var ErrSlotUnrecoverable = errors.New("the lost slot cannot be recovered from the outbox table")

// ErrRecoveryUnfinished marks a progress record left marked by a recovery
// that did not finish, met by a relay that may not recover.
var ErrRecoveryUnfinished = errors.New("a recovery of the lost slot did not finish")

// Recoverer finds, among the outbox table's rows of a window, those Kafka
// does not hold, and republishes them, as `reconcile --republish` does;
// cmd's reconcile-backed one is the real one. Its refusals wrap
// ErrSlotUnrecoverable.
type Recoverer interface {
	// Check fails, before the slot is touched, when the table cannot serve
	// the recovery of w (no created-at column, no privilege, rows of the
	// window deleted); w has no snapshot yet.
	Check(ctx context.Context, w RecoveryWindow) error
	// Recover compares and republishes the window, oldest row first.
	Recover(ctx context.Context, w RecoveryWindow) (RecoveryReport, error)
}

// RecoveryWindow is what a recovery compares: the rows created from Since
// that the exported Snapshot sees, which are exactly the rows committed
// before the new slot's consistent point.
type RecoveryWindow struct {
	Since, Until time.Time
	// HeldSince is the commit time of the last transaction Kafka is known
	// to hold: the table must still hold a row created at or before it, or
	// rows of the window were deleted.
	HeldSince time.Time
	Snapshot  string
}

// RecoveryReport is what a recovery found and did.
type RecoveryReport struct {
	RowsChecked, Found, Missing, Republished, Quarantined int64
	// Failed counts the missing events not delivered; FirstFailure says
	// why the first of them was not.
	Failed       int64
	FirstFailure string
}

// Results of a recovery, the label of outbox_relay_slot_recoveries_total.
const (
	recoveryDone    = "recovered"
	recoveryRefused = "refused"
	recoveryFailed  = "failed"
)

// validateOnSlotLost refuses a recovery the configuration cannot serve.
func (c Config) validateOnSlotLost() error {
	switch c.OnSlotLost {
	case SlotLostStop, "":
		return nil
	case SlotLostRecover:
	default:
		return fmt.Errorf("--on-slot-lost %q: use %s or %s", c.OnSlotLost, SlotLostStop, SlotLostRecover)
	}
	switch {
	case !c.Replication.ReadsTable():
		return errors.New("--on-slot-lost recover needs an outbox table to republish the gap from, and the messages source has none: events committed while its slot was lost are in no table and no slot, so the relay can only stop and say so. Use --on-slot-lost stop (the default); see docs/messages.md for what this source gives up")
	case c.RecreateLostSlot:
		return errors.New("--on-slot-lost recover and --recreate-lost-slot contradict each other: recover republishes the lost slot's gap, --recreate-lost-slot gives it up. Keep one")
	case c.Progress.Topic == "":
		return errors.New("--on-slot-lost recover needs --progress-topic: the progress record says where the gap starts, and marks a recovery until it finishes")
	case c.Recoverer == nil:
		return errors.New("--on-slot-lost recover: the relay has nothing to republish with")
	}
	return nil
}

// slotLoss is why a session recovers the slot instead of streaming it.
type slotLoss struct {
	reason string
	// drop: the slot exists (invalidated, or made by a recovery that did
	// not finish) and is dropped before the new one is made.
	drop bool
	// record is the progress record found, if any.
	record *progress.Record
}

// findSlotLoss says whether the slot is lost: invalidated, missing once
// this process streamed from it or once Kafka holds progress for it, or
// left by a recovery that did not finish. nil when the slot can be used,
// or made for the first time.
func (r *Relay) findSlotLoss(ctx context.Context, admin *replication.Admin, sys replication.System) (*slotLoss, error) {
	info, exists, err := admin.Slot(ctx)
	if err != nil {
		return nil, err
	}
	store, err := r.progress.open(ctx)
	if err != nil {
		return nil, err
	}
	readCtx, cancel := context.WithTimeout(ctx, progressTimeout)
	defer cancel()
	rec, found, err := store.Latest(readCtx, progress.Key(r.cfg.Replication.Slot, sys.ID))
	if errors.Is(err, progress.ErrTopicMissing) {
		err, found = nil, false // resume makes the topic again; no record says nothing was streamed
	}
	if err != nil {
		return nil, err
	}
	loss := &slotLoss{}
	if found {
		loss.record = &rec
	}
	r.mu.Lock()
	streamed := r.status.streamed
	r.mu.Unlock()
	switch {
	case found && !rec.RecoverySince.IsZero():
		loss.reason, loss.drop = "a recovery of the slot began and did not finish", exists
	case exists && info.Lost():
		loss.reason, loss.drop = "the slot was invalidated ("+info.Invalidation()+")", true
	case !exists && streamed:
		loss.reason = "the slot disappeared while this relay streamed from it: dropped, or PostgreSQL failed over to a server without it"
	case !exists && found:
		loss.reason = "the slot is missing although Kafka holds progress for it: dropped, or PostgreSQL failed over to a server without it"
	default:
		return nil, nil
	}
	return loss, nil
}

// recoverIfLost recovers the slot when it is lost (see findSlotLoss) and
// says whether it did; a slot that is not lost is left to PrepareSlot.
// The recovery runs under a lock of the slot's, so that two relays that
// find it lost at once take turns: the second finds it recovered. Its
// beforeResume runs before the recovery, as in exactly-once mode it fences
// every older producer before Kafka is read.
func (r *Relay) recoverIfLost(ctx context.Context, admin *replication.Admin, beforeResume func(replication.System) error) (slot replication.SlotStart, sys replication.System, recovered bool, err error) {
	sys, err = replication.IdentifySystem(ctx, r.cfg.Replication)
	if err != nil {
		return slot, sys, false, err
	}
	loss, err := r.findSlotLoss(ctx, admin, sys)
	if err != nil || loss == nil {
		return slot, sys, false, err
	}
	locked, err := admin.LockRecovery(ctx)
	if err != nil {
		return slot, sys, false, err
	}
	if !locked {
		return slot, sys, false, fmt.Errorf("%w: another relay is recovering replication slot %q (%s)", replication.ErrSlotBusy, r.cfg.Replication.Slot, loss.reason)
	}
	// Read again under the lock: the relay that held it may have just
	// recovered the slot.
	if loss, err = r.findSlotLoss(ctx, admin, sys); err != nil || loss == nil {
		return slot, sys, false, err
	}
	if err := beforeResume(sys); err != nil {
		return slot, sys, false, err
	}
	if slot, err = r.recoverSlot(ctx, admin, sys, loss); err != nil {
		return slot, sys, false, err
	}
	// Again: the start is checked against the server's WAL end, which the
	// new slot's position is past.
	sys, err = replication.IdentifySystem(ctx, r.cfg.Replication)
	return slot, sys, true, err
}

// recoverSlot replaces a lost slot and republishes its gap: it marks the
// progress record as recovering (so a crash from here on recovers again),
// makes the new slot with the snapshot of its consistent point,
// republishes the rows that snapshot sees from the window's start which
// Kafka lacks, oldest first, and only then clears the mark. The session
// streams from the new slot afterwards, so an aggregate's gap events go
// before its new ones. In exactly-once mode the session's producer was
// made first: it fenced every older one, so the comparison reads no
// transaction that could still commit.
func (r *Relay) recoverSlot(ctx context.Context, admin *replication.Admin, sys replication.System, loss *slotLoss) (replication.SlotStart, error) {
	began := time.Now()
	start, rep, since, err := r.recoverGap(ctx, admin, sys, loss)
	m := r.metrics
	switch {
	case errors.Is(err, ErrSlotUnrecoverable):
		m.SlotRecoveries.WithLabelValues(recoveryRefused).Inc()
		return start, err
	case err != nil:
		m.SlotRecoveries.WithLabelValues(recoveryFailed).Inc()
		return start, fmt.Errorf("recover the lost slot (the next session tries again): %w", err)
	}
	took := time.Since(began)
	m.SlotRecoveries.WithLabelValues(recoveryDone).Inc()
	m.SlotRecoveryRepublished.Add(float64(rep.Republished))
	m.SlotRecoverySeconds.Set(took.Seconds())
	r.log.Warn().Str("loss", loss.reason).Time("window_since", since).Str("slot_lsn", start.LSN.String()).
		Int64("rows_checked", rep.RowsChecked).Int64("found_in_kafka", rep.Found).Int64("missing", rep.Missing).
		Int64("republished", rep.Republished).Int64("quarantined", rep.Quarantined).Dur("took", took).
		Msg("recovered the lost replication slot: a new slot streams everything committed after slot_lsn, and every event of the window committed before it that Kafka lacked was republished from the outbox table; nothing for the operator to do (see docs/slot-trouble.md)")
	return start, nil
}

// recoverGap is recoverSlot's work; since is the window's start.
func (r *Relay) recoverGap(ctx context.Context, admin *replication.Admin, sys replication.System, loss *slotLoss) (start replication.SlotStart, rep RecoveryReport, since time.Time, err error) {
	since, held, err := r.recoveryWindow(loss)
	if err != nil {
		return start, rep, since, err
	}
	// Checked before the slot is made: a refusal after it would leave a
	// slot nobody streams holding WAL.
	if err := r.cfg.Recoverer.Check(ctx, RecoveryWindow{Since: since, Until: time.Now().Add(time.Hour), HeldSince: held}); err != nil {
		return start, rep, since, err
	}
	key := progress.Key(r.cfg.Replication.Slot, sys.ID)
	if loss.record == nil || loss.record.RecoverySince.IsZero() {
		mark := progress.Record{Timeline: sys.Timeline, RelayVersion: r.cfg.Progress.RelayVersion, Delivery: r.cfg.DeliveryMode(), RecoverySince: since}
		if loss.record != nil {
			mark.LSN, mark.Timeline, mark.CommitTime = loss.record.LSN, loss.record.Timeline, loss.record.CommitTime
		}
		if err := r.progress.writeNow(ctx, key, mark); err != nil {
			return start, rep, since, fmt.Errorf("mark the progress record as recovering: %w", err)
		}
	}
	r.log.Warn().Str("loss", loss.reason).Time("window_since", since).Bool("drop_first", loss.drop).
		Msg("the replication slot is lost; recovering it from the outbox table (--on-slot-lost recover): a new slot, then every event of the window that Kafka lacks")
	if loss.drop {
		if err := admin.DropSlot(ctx); err != nil {
			return start, rep, since, err
		}
	}
	snap, err := admin.CreateSlotWithSnapshot(ctx)
	if err != nil {
		return start, rep, since, err
	}
	defer snap.Close()
	rep, err = r.cfg.Recoverer.Recover(ctx, RecoveryWindow{Since: since, Until: snap.Before.Add(time.Hour), HeldSince: held, Snapshot: snap.Snapshot})
	snap.Close()
	if err != nil {
		return start, rep, since, err
	}
	if rep.Failed > 0 {
		return start, rep, since, fmt.Errorf("%d of the %d events Kafka lacked were not delivered (first: %s)", rep.Failed, rep.Missing, rep.FirstFailure)
	}
	// Kafka now holds every event committed before the new slot's
	// consistent point: that is the progress, and the mark goes.
	done := progress.Record{LSN: snap.LSN, Timeline: sys.Timeline, CommitTime: snap.Before, RelayVersion: r.cfg.Progress.RelayVersion, Delivery: r.cfg.DeliveryMode()}
	if err := r.progress.writeNow(ctx, key, done); err != nil {
		return start, rep, since, fmt.Errorf("clear the progress record's recovery mark: %w", err)
	}
	return replication.SlotStart{LSN: snap.LSN, Created: true}, rep, since, nil
}

// recoveryWindow is where the gap starts, reaching back by the retention
// margin for transactions that were open across it, and the commit time
// of the last transaction Kafka is known to hold. A recovery that did not
// finish keeps the start it chose.
func (r *Relay) recoveryWindow(loss *slotLoss) (since, held time.Time, err error) {
	if loss.record != nil && !loss.record.RecoverySince.IsZero() {
		return loss.record.RecoverySince, loss.record.CommitTime, nil
	}
	last := r.lastKnownCommit()
	if loss.record != nil {
		last = later(last, loss.record.CommitTime)
	}
	if last.IsZero() {
		return since, held, fmt.Errorf("%w: %s, and neither the progress topic nor this process knows the commit time of the last event Kafka holds, so the relay cannot tell where the gap starts. "+
			"Find it by hand: run `outbox-relay reconcile --since <a time before the loss> --until 0s --republish` with run's connection flags; then start once with --on-slot-lost stop (adding --recreate-lost-slot if the slot is invalidated)",
			ErrSlotUnrecoverable, loss.reason)
	}
	return last.Add(-r.cfg.Retention.Margin), last, nil
}
