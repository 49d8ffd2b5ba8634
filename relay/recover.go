package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/store"
)

// What a session does when the slot is gone (--on-slot-lost).
const (
	// SlotLostStop stops the relay and tells the operator what to run.
	SlotLostStop = "stop"
	// SlotLostRecover makes a new slot and republishes, from the outbox
	// table, what the lost one never streamed.
	SlotLostRecover = "recover"
)

// What a session does with the rows already in the outbox table when it
// must make a slot that no record covers (--existing-rows): a first start
// over rows written before the relay ran, or a slot whose history is lost.
const (
	// ExistingRowsRefuse stops and names the choices.
	ExistingRowsRefuse = "refuse"
	// ExistingRowsPending makes the slot with its snapshot and republishes
	// every row of the table Kafka lacks, as a recovery of the whole table.
	ExistingRowsPending = replication.ExistingPending
	// ExistingRowsPublished makes the slot and publishes nothing committed
	// before it.
	ExistingRowsPublished = replication.ExistingPublished
)

// ErrSlotUnrecoverable marks a lost slot whose gap the outbox table cannot
// cover: retrying cannot fix it, the operator must.
var ErrSlotUnrecoverable = errors.New("the lost slot cannot be recovered from the outbox table")

// ErrRecoveryHalted marks a recovery stopped by an event Kafka refuses for
// good, under --on-permanent-error halt.
var ErrRecoveryHalted = errors.New("the recovery of the lost slot halted on an event Kafka refuses")

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
	// Progress, when set, is told how far the recovery is: its phase, and
	// the rows or records done of the total.
	Progress func(phase string, done, total int64)
}

// RecoveryReport is what a recovery found and did.
type RecoveryReport struct {
	RowsChecked, Found, Missing, Republished, Quarantined int64
	// Failed counts the missing events not delivered; FirstFailure says
	// why the first of them was not.
	Failed       int64
	FirstFailure string
	// Permanent says a failure was a refusal for good (an invalid topic, a
	// record too large), which retrying cannot fix.
	Permanent bool
}

// Results of a recovery, the label of outbox_relay_slot_recoveries_total.
const (
	recoveryDone    = "recovered"
	recoveryRefused = "refused"
	recoveryFailed  = "failed"
)

// validateExistingRows refuses an --existing-rows the configuration
// cannot serve.
func (c Config) validateExistingRows() error {
	switch c.ExistingRows {
	case ExistingRowsRefuse, "":
		return nil
	case ExistingRowsPending, ExistingRowsPublished:
	default:
		return fmt.Errorf("--existing-rows %q: use %s, %s or %s", c.ExistingRows, ExistingRowsRefuse, ExistingRowsPending, ExistingRowsPublished)
	}
	switch {
	case !c.Replication.ReadsTable():
		return fmt.Errorf("--existing-rows %s with the messages source: it has no table whose rows a new slot could leave behind; drop the flag", c.ExistingRows)
	case c.DryRun != nil:
		return fmt.Errorf("--existing-rows %s with --dry-run: a dry run streams from a temporary slot and makes no slot of its own; drop one of them", c.ExistingRows)
	case c.ExistingRows == ExistingRowsPublished && c.OnSlotLost == SlotLostRecover:
		return errors.New("--existing-rows published and --on-slot-lost recover contradict each other: recover republishes a lost slot's gap, published gives it up. Keep one")
	case c.ExistingRows == ExistingRowsPending && c.RecreateLostSlot:
		return errors.New("--existing-rows pending and --recreate-lost-slot contradict each other: pending republishes what the lost slot left behind, --recreate-lost-slot gives it up. Keep one")
	case c.ExistingRows == ExistingRowsPending && c.Recoverer == nil:
		return errors.New("--existing-rows pending: the relay has nothing to republish with")
	}
	return nil
}

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

// What a slot loss is, for what each choice does about it.
type lossKind int

const (
	// lossUnfinished: the progress record marks a recovery that did not
	// finish.
	lossUnfinished lossKind = iota
	// lossInvalidated: the server invalidated the slot.
	lossInvalidated
	// lossMissing: the slot is missing, and something says it existed:
	// this process streamed from it, Kafka holds progress for it, or its
	// record in PostgreSQL says it was made.
	lossMissing
	// lossUnrecorded: the slot is missing, nothing says it existed, and
	// the table holds rows: a first start over rows written before the
	// relay ran, or a history lost with its record.
	lossUnrecorded
)

// slotLoss is why a session may not simply stream the slot, or make it.
type slotLoss struct {
	kind   lossKind
	reason string
	// drop: the slot exists (invalidated, or made by a recovery that did
	// not finish) and is dropped before the new one is made.
	drop bool
	// record is the progress record found, if any.
	record *progress.Record
	// made is the slot's record in PostgreSQL, if one says it was made.
	made *replication.SlotRecord
	// wholeTable: --existing-rows pending compares every row of the table
	// with Kafka, whatever says where the gap starts.
	wholeTable bool
}

// findSlotLoss says whether the slot is lost: invalidated, missing while
// anything durable says it existed, missing over rows that nothing says
// were published, or left by a recovery that did not finish. nil when the
// slot can be streamed, or made with nothing left behind; existing then
// says what the table held, for the record of a slot made now.
func (r *Relay) findSlotLoss(ctx context.Context, admin *replication.Admin, sys replication.System) (loss *slotLoss, existing string, err error) {
	info, exists, err := admin.Slot(ctx)
	if err != nil {
		return nil, "", err
	}
	hist, err := admin.History(ctx)
	if err != nil {
		return nil, "", err
	}
	if !exists {
		// Everything that can be checked is checked before a slot is
		// made or recovered: a start that fails after leaves it holding
		// WAL. This also opens the progress store read below.
		if err := r.beforeSlotCreate(ctx); err != nil {
			return nil, "", err
		}
	}
	readCtx, cancel := context.WithTimeout(ctx, progressTimeout)
	defer cancel()
	store, err := r.progress.open(ctx)
	if err != nil {
		return nil, "", err
	}
	rec, found, err := store.Latest(readCtx, progress.Key(r.cfg.Replication.Slot, sys.ID))
	if errors.Is(err, progress.ErrTopicMissing) {
		err, found = nil, false // resume makes the topic again; no record says nothing was streamed
	}
	if errors.Is(err, progress.ErrBadRecord) && r.cfg.Progress.Reset {
		err, found = nil, false // --reset-progress overwrites it
	}
	if err != nil {
		return nil, "", badRecordAdvice(err)
	}
	loss = &slotLoss{made: hist.Record}
	if found {
		loss.record = &rec
	}
	r.mu.Lock()
	streamed := r.status.streamed
	r.mu.Unlock()
	switch {
	case found && !rec.RecoverySince.IsZero():
		loss.kind, loss.reason, loss.drop = lossUnfinished, "a recovery of the slot began and did not finish", exists
	case exists && info.Lost():
		loss.kind, loss.reason, loss.drop = lossInvalidated, "the slot was invalidated ("+info.Invalidation()+")", true
	case exists:
		if hist.Record == nil && !hist.NoRegistry {
			existing = replication.ExistingAdopted
		}
		return nil, existing, nil
	case streamed:
		loss.kind, loss.reason = lossMissing, fmt.Sprintf("replication slot %q no longer exists although this relay streamed from it (the last commit it confirmed: %s): it was dropped, or PostgreSQL failed over to a server without it",
			r.cfg.Replication.Slot, formatCommit(r.lastKnownCommit()))
	case found:
		loss.kind, loss.reason = lossMissing, "the slot is missing although Kafka holds progress for it: dropped, or PostgreSQL failed over to a server without it"
	default:
		why, existing, err := admin.WhyNotMake(ctx, hist)
		if err != nil || why == "" {
			return nil, existing, err
		}
		loss.kind, loss.reason = lossUnrecorded, why
		if hist.Record != nil {
			loss.kind = lossMissing
		}
	}
	return loss, "", nil
}

// formatCommit is a commit time for a message; "unknown" when zero.
func formatCommit(t time.Time) string {
	if t.IsZero() {
		return "unknown"
	}
	return t.UTC().Format(time.RFC3339)
}

// badRecordAdvice adds to an unusable progress record's error what the
// operator can do.
func badRecordAdvice(err error) error {
	if !errors.Is(err, progress.ErrBadRecord) {
		return err
	}
	return fmt.Errorf("%w. The relay will not guess where Kafka's progress is: start it once with --reset-progress, which starts from the slot's own position and overwrites the record (events after that position are sent again; none is skipped)", err)
}

// prepareTableSlot readies the slot of a table source. A slot that exists
// and is sound, or one made over a table with nothing in it, is left to
// PrepareSlot (handled false). A lost one, or one that would be made over
// rows no record covers, is what --existing-rows and --on-slot-lost
// decide: made over them (published), recovered from the table (pending,
// or recover), or refused with the choices. beforeResume runs once,
// before the progress record is read, and in exactly-once mode before a
// recovery reads Kafka.
func (r *Relay) prepareTableSlot(ctx context.Context, admin *replication.Admin, beforeResume func(replication.System) error) (slot replication.SlotStart, sys replication.System, existing string, handled bool, err error) {
	sys, err = replication.IdentifySystem(ctx, r.cfg.Replication)
	if err != nil {
		return slot, sys, "", false, err
	}
	loss, existing, err := r.findSlotLoss(ctx, admin, sys)
	if err != nil || loss == nil {
		return slot, sys, existing, false, err
	}
	choice := r.existingRowsChoice()
	switch {
	case choice == ExistingRowsPublished && loss.kind != lossUnfinished,
		choice == ExistingRowsPending, r.cfg.OnSlotLost == SlotLostRecover:
	case loss.kind == lossInvalidated || loss.kind == lossUnfinished && loss.drop:
		// PrepareSlot refuses an invalidated slot (or recreates it under
		// --recreate-lost-slot), and resume refuses an unfinished
		// recovery's mark on the slot it made, each with its advice.
		return slot, sys, "", false, nil
	case loss.kind == lossUnfinished:
		// The recovery died before its slot existed: making one here,
		// before resume refuses the mark, would leave a slot over the gap
		// with no record, which a later start could stream silently.
		return slot, sys, "", true, fmt.Errorf("%w: the progress record marks a recovery of the lost slot that began and did not finish, and slot %q does not exist. Start with --on-slot-lost recover (or once with --existing-rows pending, which compares the whole table) to finish it",
			ErrRecoveryUnfinished, r.cfg.Replication.Slot)
	default:
		err := replication.LostHistoryError(r.cfg.Replication, loss.reason, false)
		if loss.kind == lossMissing {
			err = fmt.Errorf("%w: %w", replication.ErrSlotMissing, err)
		}
		return slot, sys, "", true, err
	}
	locked, err := admin.LockRecovery(ctx)
	if err != nil {
		return slot, sys, "", true, err
	}
	if !locked {
		return slot, sys, "", true, fmt.Errorf("%w: another relay is recovering replication slot %q (%s)", replication.ErrSlotBusy, r.cfg.Replication.Slot, loss.reason)
	}
	// Read again under the lock: the relay that held it may have just
	// made the slot.
	if loss, existing, err = r.findSlotLoss(ctx, admin, sys); err != nil || loss == nil {
		return slot, sys, existing, false, err
	}
	if err := beforeResume(sys); err != nil {
		return slot, sys, "", true, err
	}
	if choice == ExistingRowsPublished && loss.kind != lossUnfinished {
		slot, err = r.makeSlotOver(ctx, admin, loss)
		return slot, sys, "", true, err
	}
	loss.wholeTable = choice == ExistingRowsPending
	if slot, err = r.recoverSlot(ctx, admin, sys, loss); err != nil {
		return slot, sys, "", true, err
	}
	// Again: the start is checked against the server's WAL end, which the
	// new slot's position is past.
	sys, err = replication.IdentifySystem(ctx, r.cfg.Replication)
	return slot, sys, "", true, err
}

// existingRowsChoice is --existing-rows for this session: the choice is
// made for the start it was given to. Once this process streamed, a slot
// lost under it is a new loss, which --on-slot-lost decides.
func (r *Relay) existingRowsChoice() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.status.streamed {
		return ExistingRowsRefuse
	}
	return r.cfg.ExistingRows
}

// makeSlotOver makes the slot over what the lost one (or no slot) left
// behind, publishing none of it: --existing-rows published, the
// operator's choice. It is loud about it, and records it.
func (r *Relay) makeSlotOver(ctx context.Context, admin *replication.Admin, loss *slotLoss) (replication.SlotStart, error) {
	if err := r.beforeSlotCreate(ctx); err != nil {
		return replication.SlotStart{}, err
	}
	if loss.drop {
		if err := admin.DropSlot(ctx); err != nil {
			return replication.SlotStart{}, err
		}
	}
	before, err := admin.Clock(ctx)
	if err != nil {
		return replication.SlotStart{}, err
	}
	at, err := admin.CreateSlot(ctx)
	if err != nil {
		return replication.SlotStart{}, err
	}
	r.recordSlot(ctx, admin, replication.SlotRecord{LSN: at, CreatedAt: before, CreatedBy: "run", ExistingRows: replication.ExistingPublished})
	LogNewSlot(ctx, r.log, admin, r.cfg.Replication, at)
	r.log.Error().Str("loss", loss.reason).Str("lsn", at.String()).Time("slot_created_at", before).
		Msg("made the replication slot over rows it has no record of publishing, as --existing-rows published says: events committed before slot_created_at that Kafka lacks are NOT published. If that was not meant, find them with `outbox-relay reconcile --since <a time before the loss> --until <slot_created_at>` and add --republish (see docs/slot-trouble.md)")
	return replication.SlotStart{LSN: at, Created: true}, nil
}

// recordSlot writes the record of a slot made now, and counts it. A
// record that cannot be written only weakens what a later loss can tell,
// so it is a warning, not a stop.
func (r *Relay) recordSlot(ctx context.Context, admin *replication.Admin, rec replication.SlotRecord) {
	if rec.ExistingRows != replication.ExistingAdopted {
		r.metrics.SlotsMade.WithLabelValues(rec.ExistingRows).Inc()
	}
	if err := admin.RecordSlot(ctx, rec); err != nil {
		r.log.Warn().Err(err).Msg("cannot record the replication slot in PostgreSQL: should it be lost, the relay cannot tell that from a first start and will stop and ask")
	}
}

// recoverSlot replaces a lost slot and republishes its gap: it marks the
// progress record as recovering (so a crash from here on recovers again),
// makes the new slot with the snapshot of its consistent point,
// republishes the rows that snapshot sees from the window's start which
// Kafka lacks, oldest first, and only then clears the mark. The session
// streams from the new slot afterwards, so an aggregate's gap events go
// before its new ones. In exactly-once mode the session's producer was
// made first: it fenced every older one, so the comparison reads no
// transaction that could still commit. Meanwhile the state is recovering,
// with how far it is, and the watchdog is pinged: the new slot waits for
// every transaction open when it is made, and a window can hold millions
// of rows.
func (r *Relay) recoverSlot(ctx context.Context, admin *replication.Admin, sys replication.System, loss *slotLoss) (replication.SlotStart, error) {
	began := time.Now()
	r.setState(pipeline.StateRecovering, nil)
	r.setDetail(recoveryWord(loss) + ": " + loss.reason)
	stopPings := r.pingWhileRecovering(ctx)
	start, rep, since, err := r.recoverGap(ctx, admin, sys, loss)
	stopPings()
	m := r.metrics
	switch {
	case errors.Is(err, ErrSlotUnrecoverable) || IsFatal(err):
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
	todo := "nothing for the operator to do"
	if rep.Quarantined > 0 {
		todo = "the quarantined events wait in the quarantine table: `outbox-relay quarantine list`, then `quarantine replay` once their cause is fixed"
	}
	r.log.Warn().Str("loss", loss.reason).Time("window_since", since).Bool("whole_table", loss.wholeTable).Str("slot_lsn", start.LSN.String()).
		Int64("rows_checked", rep.RowsChecked).Int64("found_in_kafka", rep.Found).Int64("missing", rep.Missing).
		Int64("republished", rep.Republished).Int64("quarantined", rep.Quarantined).Dur("took", took).
		Msg("recovered the lost replication slot: a new slot streams everything committed after slot_lsn, and every event of the window committed before it that Kafka lacked was republished from the outbox table; " + todo + " (see docs/slot-trouble.md)")
	return start, nil
}

// recoveryWord names what a recovery does, for the status.
func recoveryWord(loss *slotLoss) string {
	if loss.wholeTable {
		return "republishing what Kafka lacks of the table (--existing-rows pending)"
	}
	return "recovering the lost slot"
}

// pingWhileRecovering tells the process around the relay, every status
// interval until stopped, that the recovery is still at work.
func (r *Relay) pingWhileRecovering(ctx context.Context) (stop func()) {
	if r.hooks.Alive == nil {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		// Often enough that the notifier's own pacing, not this tick,
		// decides when systemd hears from the relay.
		tick := time.NewTicker(min(r.cfg.StatusInterval, 200*time.Millisecond))
		defer tick.Stop()
		for {
			r.hooks.Alive()
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
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
	if loss.record == nil || loss.record.RecoverySince.IsZero() || loss.wholeTable {
		mark := progress.Record{Timeline: sys.Timeline, RelayVersion: r.cfg.Progress.RelayVersion, Delivery: r.cfg.DeliveryMode(), RecoverySince: since}
		if since.IsZero() {
			mark.RecoverySince = wholeTableSince
		}
		if loss.record != nil {
			mark.LSN, mark.Timeline, mark.CommitTime = loss.record.LSN, loss.record.Timeline, loss.record.CommitTime
		}
		if err := r.progress.writeNow(ctx, key, mark); err != nil {
			return start, rep, since, fmt.Errorf("mark the progress record as recovering: %w", err)
		}
	}
	msg := "the replication slot is lost; recovering it from the outbox table (--on-slot-lost recover): a new slot, then every event of the window that Kafka lacks"
	if loss.wholeTable {
		msg = "the replication slot is lost, or was never made over the rows the table holds; making a new slot, then republishing every row of the table that Kafka lacks (--existing-rows pending)"
	}
	r.log.Warn().Str("loss", loss.reason).Time("window_since", since).Bool("whole_table", loss.wholeTable).Bool("drop_first", loss.drop).Msg(msg)
	if loss.drop {
		if err := admin.DropSlot(ctx); err != nil {
			return start, rep, since, err
		}
	}
	r.setDetail(recoveryWord(loss) + ": making the new slot (it waits for the transactions open now to end)")
	snap, err := admin.CreateSlotWithSnapshot(ctx)
	if err != nil {
		return start, rep, since, err
	}
	defer snap.Close()
	rep, err = r.cfg.Recoverer.Recover(ctx, RecoveryWindow{Since: since, Until: snap.Before.Add(time.Hour), HeldSince: held, Snapshot: snap.Snapshot,
		Progress: func(phase string, done, total int64) {
			r.setDetail(fmt.Sprintf("%s: %s %d of %d", recoveryWord(loss), phase, done, total))
		}})
	snap.Close()
	if err != nil {
		return start, rep, since, err
	}
	if rep.Failed > 0 {
		err := fmt.Errorf("%d of the %d events Kafka lacked were not delivered (first: %s)", rep.Failed, rep.Missing, rep.FirstFailure)
		if rep.Permanent && r.cfg.OnPermanentError == pipeline.OnPermanentHalt {
			// Retrying republishes the same window to the same refusal:
			// halt means stop, as on the streaming path.
			return start, rep, since, fmt.Errorf("%w: %w. --on-permanent-error halt stops here; fix the event (or start with --on-permanent-error quarantine to set it aside) and start again: the recovery resumes from its mark", ErrRecoveryHalted, err)
		}
		return start, rep, since, err
	}
	existing := replication.ExistingRecovered
	if loss.wholeTable {
		existing = replication.ExistingPending
	}
	r.recordSlot(ctx, admin, replication.SlotRecord{LSN: snap.LSN, CreatedAt: snap.Before, CreatedBy: "run", ExistingRows: existing})
	// Kafka now holds every event committed before the new slot's
	// consistent point: that is the progress, and the mark goes.
	done := progress.Record{LSN: snap.LSN, Timeline: sys.Timeline, CommitTime: snap.Before, RelayVersion: r.cfg.Progress.RelayVersion, Delivery: r.cfg.DeliveryMode()}
	if err := r.progress.writeNow(ctx, key, done); err != nil {
		return start, rep, since, fmt.Errorf("clear the progress record's recovery mark: %w", err)
	}
	return replication.SlotStart{LSN: snap.LSN, Created: true}, rep, since, nil
}

// wholeTableSince is the recovery mark of --existing-rows pending, which
// has no window start: a time before any row, that a record can carry.
var wholeTableSince = time.Unix(0, 0).UTC()

// recoveryWindow is where the gap starts, reaching back by the retention
// margin for transactions that were open across it, and the commit time
// of the last transaction Kafka is known to hold (zero: nothing says). A
// recovery that did not finish keeps the start it chose; --existing-rows
// pending takes the whole table. Without a progress record, the slot's
// record says since when its events may be missing: since it was made.
func (r *Relay) recoveryWindow(loss *slotLoss) (since, held time.Time, err error) {
	if loss.wholeTable {
		return time.Time{}, time.Time{}, nil
	}
	if loss.record != nil && !loss.record.RecoverySince.IsZero() {
		if loss.record.RecoverySince.Equal(wholeTableSince) {
			return time.Time{}, time.Time{}, nil
		}
		return loss.record.RecoverySince, loss.record.CommitTime, nil
	}
	last := r.lastKnownCommit()
	if loss.record != nil {
		last = later(last, loss.record.CommitTime)
	}
	if last.IsZero() && loss.made != nil {
		if loss.made.CreatedAt.After(time.Now().Add(time.Minute)) {
			// The record was changed (or the clock jumped): a window from
			// it would begin after the loss and miss the gap.
			return since, held, fmt.Errorf("%w: %w", ErrSlotUnrecoverable, replication.LostHistoryError(r.cfg.Replication,
				loss.reason+fmt.Sprintf("; its record in %s says the slot was made at %s, which is in the future, so it cannot say where the gap starts", store.SlotRegistryName, loss.made.CreatedAt.UTC().Format(time.RFC3339)), false))
		}
		return loss.made.CreatedAt.Add(-r.cfg.Retention.Margin), time.Time{}, nil
	}
	if last.IsZero() {
		return since, held, fmt.Errorf("%w: %w", ErrSlotUnrecoverable,
			replication.LostHistoryError(r.cfg.Replication, loss.reason+"; neither a progress record, nor this process, nor a record of the slot says where the gap starts", false))
	}
	return last.Add(-r.cfg.Retention.Margin), last, nil
}
