package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/store"
)

// WatchSlot keeps the slot's gauges current until ctx ends: every `every`
// it reads the slot from PostgreSQL and sets outbox_relay_slot_active,
// _slot_retained_wal_bytes, _slot_lag_bytes and _slot_wal_status, keeps the
// reading for /slot, counts the quarantine table for
// outbox_relay_quarantined_events (so a replay by another process shows
// too), and refreshes the in-flight gauges from the relay's own state. It
// logs once when the slot's wal_status becomes unreserved or lost (the
// server is about to remove, or removed, WAL the slot needs), and once when
// it recovers. It works whether this instance streams or is a standby, on
// connections of its own.
func (r *Relay) WatchSlot(ctx context.Context, every time.Duration) {
	r.newSlotWatch().run(ctx, every)
}

// newSlotWatch gives the watch what it reads and writes: the relay's
// configuration, the view it keeps current, and a getter of the stream's
// state. It holds no *Relay.
func (r *Relay) newSlotWatch() *slotWatch {
	w := &slotWatch{cfg: r.cfg.Replication, log: r.log, metrics: r.metrics, view: &r.slot, stream: r.streamState, started: time.Now()}
	if r.cfg.OnPermanentError == pipeline.OnPermanentQuarantine {
		table, err := r.cfg.quarantineTable()
		conn := r.cfg.Replication.Config
		w.openQuarantine = func(ctx context.Context) (*store.Quarantine, error) {
			if err != nil {
				return nil, err
			}
			return store.OpenQuarantine(ctx, conn, table, store.ForList)
		}
	}
	return w
}

// slotWatch is WatchSlot's state between readings. It was the slot
// poller: renamed so that it is not taken for poll mode (package poll).
type slotWatch struct {
	cfg     replication.Config
	log     zerolog.Logger
	metrics *Metrics
	view    *slotView // what the watch found, for the relay's status and the WAL reader
	stream  func(now time.Time) (inFlight int, unpublishedAge float64)
	// openQuarantine opens the quarantine table to count it; nil when
	// events are never quarantined.
	openQuarantine func(context.Context) (*store.Quarantine, error)

	admin      *replication.Admin
	quarantine *store.Quarantine // nil until opened
	walState   string            // the wal_status last logged about
	limits     replication.SlotLimits
	guard      walGuard
	failing    bool // the last read failed, and that was logged
	limitsRead bool // the slot limits were read and warned about

	// What the slot's position says of the events the relay has not read
	// (see slotView.unpublishedAge).
	started  time.Time // when watching began: the oldest a reading can be
	lastRead time.Time // when the last good reading began
	marks    []walMark // readings whose WAL end the slot has not confirmed yet, oldest first
	caughtUp time.Time // the newest reading whose WAL end the slot confirmed
}

func (p *slotWatch) run(ctx context.Context, every time.Duration) {
	p.view.watching(p.started)
	defer p.close()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		p.poll(ctx, every)
		timer.Reset(every)
	}
}

// walMark is the server's WAL end as a reading found it, and when that
// reading began: every transaction committed before then ends at or before
// it.
type walMark struct {
	at  time.Time
	end lsn.LSN
}

// maxWALMarks bounds the readings kept while the slot stays behind (an
// hour at the 5 s poll). Dropping the oldest keeps the anchor where it
// was, so the age can only be overstated, never understated.
const maxWALMarks = 720

func (p *slotWatch) close() {
	p.closeSlot()
	p.closeQuarantine()
}

func (p *slotWatch) closeSlot() {
	if p.admin != nil {
		p.admin.Close(context.Background())
		p.admin = nil
	}
}

func (p *slotWatch) closeQuarantine() {
	if p.quarantine != nil {
		p.quarantine.Close()
		p.quarantine = nil
	}
}

func (p *slotWatch) poll(ctx context.Context, every time.Duration) {
	m := p.metrics
	// Set after the reading, from what it and the earlier ones say.
	defer func() {
		now := time.Now()
		inFlight, age := p.stream(now)
		m.InFlightEvents.Set(float64(inFlight))
		m.OldestUnpublished.Set(age)
		m.SlotReadingAge.Set(now.Sub(later(p.lastRead, p.started)).Seconds())
	}()

	ctx, cancel := context.WithTimeout(ctx, max(every, 10*time.Second))
	defer cancel()
	p.countQuarantined(ctx)
	// Taken before the query: a transaction committed before this time
	// ends at or before the WAL end the query reads.
	began := time.Now()
	info, exists, err := p.read(ctx)
	if ctx.Err() != nil && err != nil {
		return // shutting down, or the read took too long; try again later
	}
	var guard *guardReading
	if err == nil && exists {
		if end, perr := lsn.Parse(info.CurrentLSN); perr == nil {
			p.guard.note(began, end)
		}
		g := p.guard.reading(info, p.limits, time.Now())
		m.SlotTimeLeft.Set(g.Left)
		guard = &g
	}
	p.noteReading(info, exists, err, time.Now(), guard)
	if err != nil || !exists {
		// Nobody can stream from a slot that cannot be read or is gone.
		m.SlotActive.Set(0)
		if !p.failing {
			p.failing = true
			ev := p.log.Warn()
			if err != nil {
				ev.Str("error", pg.RedactError(err.Error(), p.cfg.DSN)).
					Msg("cannot read the replication slot's state; the slot gauges keep their last values")
			} else {
				ev.Msg("the replication slot does not exist")
			}
		}
		return
	}
	if p.failing {
		p.failing = false
		p.log.Info().Msg("reading the replication slot's state again")
	}
	p.notePosition(info, began)
	if info.Active {
		m.SlotActive.Set(1)
	} else {
		m.SlotActive.Set(0)
	}
	if info.RetainedWALBytes != nil {
		m.SlotRetainedWAL.Set(*info.RetainedWALBytes)
	}
	if info.LagBytes != nil {
		m.SlotLag.Set(*info.LagBytes)
	}
	walStatus := ""
	if info.WALStatus != nil {
		walStatus = *info.WALStatus
	}
	if info.Lost() {
		walStatus = "lost" // invalidated for a reason other than removed WAL
	}
	m.setWALStatus(walStatus)
	p.noteWALStatus(info, walStatus)
}

// noteReading keeps a reading, begun at at, and what the guard said of
// it, for /slot.
func (p *slotWatch) noteReading(info *replication.SlotInfo, exists bool, err error, at time.Time, guard *guardReading) {
	reading := slotReading{info: info, at: at, guard: guard}
	switch {
	case err != nil:
		reading.err = pg.RedactError(err.Error(), p.cfg.DSN)
	case !exists:
		reading.err = (&slotMissingError{slot: p.cfg.Slot}).Error()
	}
	p.view.noteReading(reading)
}

// read returns the slot's state, connecting first when needed. A failed
// query drops the connection, so the next poll starts afresh.
func (p *slotWatch) read(ctx context.Context) (*replication.SlotInfo, bool, error) {
	if p.admin == nil {
		admin, err := replication.Connect(ctx, p.cfg)
		if err != nil {
			return nil, false, err
		}
		p.admin = admin
	}
	if !p.limitsRead {
		p.warnSlotLimits(ctx)
	}
	info, exists, err := p.admin.Slot(ctx)
	if err != nil {
		p.closeSlot()
	}
	return info, exists, err
}

// warnSlotLimits warns once per process about settings that invalidate
// the slot while the relay is down; a failed read is tried again at the
// next poll.
func (p *slotWatch) warnSlotLimits(ctx context.Context) {
	limits, err := p.admin.SlotLimits(ctx)
	if err != nil {
		p.log.Debug().Str("error", pg.RedactError(err.Error(), p.cfg.DSN)).Msg("cannot read the slot limits")
		return
	}
	p.limitsRead, p.limits = true, limits
	for _, w := range limits.Warnings() {
		p.log.Warn().Msg(w)
	}
}

// countQuarantined sets the quarantined gauge and status from the table.
// The session reports its own failure to open the table; here a failure
// only leaves the last count in place.
func (p *slotWatch) countQuarantined(ctx context.Context) {
	if p.openQuarantine == nil {
		return
	}
	if p.quarantine == nil {
		q, err := p.openQuarantine(ctx)
		if err != nil {
			p.log.Debug().Str("error", pg.RedactError(err.Error(), p.cfg.DSN)).Msg("cannot count quarantined events")
			return
		}
		p.quarantine = q
	}
	n, err := p.quarantine.Count(ctx)
	if err != nil {
		p.closeQuarantine()
		return
	}
	p.metrics.Quarantined.Set(float64(n))
	p.view.noteQuarantined(n)
}

// slotPolicy is what a session may do about the slot: once this relay
// has streamed from it, it must still exist.
func (r *Relay) slotPolicy() replication.SlotPolicy {
	// What this process confirmed, or else the progress record it started
	// from: the error for a vanished slot prints that time.
	lastCommit := r.lastKnownCommit()
	r.mu.Lock()
	defer r.mu.Unlock()
	return replication.SlotPolicy{
		RecreateLost:        r.cfg.RecreateLostSlot,
		MustExist:           r.status.streamed,
		LastConfirmedCommit: lastCommit,
	}
}

// logSlotCreated says what creating or recreating the slot means for the
// rows already in the table.
func (r *Relay) logSlotCreated(ctx context.Context, admin *replication.Admin, slot replication.SlotStart) {
	messages := !r.cfg.Replication.ReadsTable()
	if slot.RecreatedLost {
		msg := "slot was invalidated and --recreate-lost-slot is set: dropped and recreated it; events committed while it was lost are NOT delivered (the reconcile_command of the next line finds them)"
		if messages {
			msg = "slot was invalidated and --recreate-lost-slot is set: dropped and recreated it; events committed while it was lost are NOT delivered: " +
				r.cfg.Replication.GapAdvice("the last event Kafka holds")
		}
		r.log.Error().Str("lsn", slot.LSN.String()).Msg(msg)
	}
	if slot.Created {
		LogNewSlot(ctx, r.log, admin, r.cfg.Replication, slot.LSN)
	}
}

// LogNewSlot says what a slot just created at at means for what was
// committed before it: `run` and `migrate` both make slots, and a slot made
// over rows of a lost one hides their gap unless this says so.
func LogNewSlot(ctx context.Context, log zerolog.Logger, admin *replication.Admin, cfg replication.Config, at lsn.LSN) {
	if !cfg.ReadsTable() {
		// No table to count: what committed before the slot is gone from
		// reach, and only the writers can say whether any of it mattered.
		log.Info().Str("lsn", at.String()).
			Msg("created the replication slot; messages committed before it existed are in no slot and are not published (run `outbox-relay migrate --source messages` at deploy time so the slot exists before services emit)")
		return
	}
	ev := log.Info()
	rows, err := admin.ExistingRows(ctx)
	switch {
	case err != nil:
		// The relay's role need not read the table; the slot exists
		// either way, so say what could not be checked and go on.
		ev = log.Warn().AnErr("count_error", err)
	case rows.Count > 0:
		// Rows an earlier slot published are in the count too, so the
		// count alone proves nothing was missed or lost; the newest row's
		// age says how likely it is that something was.
		ev = log.Warn().Int64("rows_in_table", rows.Count)
		if !rows.NewestCreated.IsZero() {
			ev = ev.Time("newest_row_created_at", rows.NewestCreated).
				Str("newest_row_age", time.Since(rows.NewestCreated).Round(time.Second).String()).
				Str("reconcile_command", reconcileCommand(rows.OldestCreated, time.Now()))
		}
	}
	ev.Str("lsn", at.String()).
		Msg("created the replication slot; rows committed before it existed are not published by it. rows_in_table counts them, including any an earlier slot published: if an earlier slot was lost (dropped, or a failover to a server without it), run reconcile_command to find what Kafka lacks and add --republish to send it; for a new table, create the slot before services write")
}

// reconcileCommand is the command that finds, among the rows committed
// before the slot existed, those no earlier slot published.
func reconcileCommand(oldest, created time.Time) string {
	return fmt.Sprintf("outbox-relay reconcile --since %s --until %s (with run's connection flags; add --republish to send what it finds)",
		oldest.UTC().Truncate(time.Second).Format(time.RFC3339), created.UTC().Add(time.Second).Truncate(time.Second).Format(time.RFC3339))
}

// noteWALStatus logs when the slot's WAL starts or stops being at risk.
func (p *slotWatch) noteWALStatus(info *replication.SlotInfo, walStatus string) {
	atRisk := walStatus == "unreserved" || walStatus == "lost"
	switch {
	case atRisk && walStatus != p.walState:
		ev := p.log.Error().Str("wal_status", walStatus)
		if info.SafeWALSize != nil {
			ev = ev.Int64("safe_wal_size", *info.SafeWALSize)
		}
		if info.RetainedWALBytes != nil {
			ev = ev.Float64("retained_wal_bytes", *info.RetainedWALBytes)
		}
		if walStatus == "lost" {
			ev.Msg("PostgreSQL invalidated the replication slot (" + info.Invalidation() + "): events it no longer holds can no longer be delivered; see docs/slot-trouble.md")
		} else {
			ev.Msg("the replication slot holds more WAL than max_slot_wal_keep_size allows: PostgreSQL will invalidate it at the next checkpoint unless the relay catches up")
		}
		p.walState = walStatus
	case !atRisk && p.walState != "":
		p.log.Info().Str("wal_status", walStatus).Msg("the replication slot's WAL is no longer at risk")
		p.walState = ""
	}
}

// notePosition keeps what a good reading of the slot, begun at at, says
// of the WAL the slot has confirmed.
func (p *slotWatch) notePosition(info *replication.SlotInfo, at time.Time) {
	p.lastRead = at
	confirmed, err := info.Confirmed()
	if err != nil {
		return
	}
	end, err := lsn.Parse(info.CurrentLSN)
	if err != nil {
		return
	}
	// Once the slot confirmed a reading's WAL end, every transaction
	// committed before that reading began is published (or quarantined).
	keep := p.marks[:0]
	for _, mark := range p.marks {
		if mark.end <= confirmed {
			p.caughtUp = later(p.caughtUp, mark.at)
		} else {
			keep = append(keep, mark)
		}
	}
	p.marks = keep
	behind := confirmed < end
	if !behind {
		p.caughtUp = later(p.caughtUp, at)
	} else {
		if len(p.marks) == maxWALMarks {
			p.marks = append(p.marks[:0], p.marks[1:]...)
		}
		p.marks = append(p.marks, walMark{at: at, end: end})
	}
	p.view.note(p.caughtUp, behind)
}
