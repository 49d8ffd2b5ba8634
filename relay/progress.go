package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/await"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/replication"
)

// ProgressOptions say where the relay keeps its progress in Kafka.
type ProgressOptions struct {
	// Topic is the compacted topic holding one record per slot and
	// cluster (--progress-topic).
	Topic string
	// Reset ignores the stored record at the first start of this process
	// and starts from the slot (--reset-progress).
	Reset bool
	// RelayVersion is written into each record, for operators.
	RelayVersion string
}

// progressTimeout bounds opening the progress topic and reading the record
// at a session's start.
const progressTimeout = 30 * time.Second

// progressKeeper keeps the relay's progress in Kafka across sessions: the
// store and its writer, opened by the first session and closed when Run
// returns, the key and timeline the last start decided, and what Kafka
// last stored, for the status. Sessions take their part of it when they
// start (feed, txnProgress); the WAL reader then notes what Kafka stored.
type progressKeeper struct {
	cfg     Config
	log     zerolog.Logger
	metrics *progressMetrics

	mu        sync.Mutex
	store     progress.Store
	writer    *progress.Writer
	resetDone bool
	key       []byte // this session's slot@systemid
	timeline  uint32 // this session's server timeline

	report ProgressStatus
}

// ProgressStatus is the progress part of the relay's status.
type ProgressStatus struct {
	Topic string `json:"topic"`
	// LSN is the newest position stored in Kafka (written, or read at the
	// last start); empty when none is known.
	LSN        string     `json:"lsn,omitempty"`
	Timeline   uint32     `json:"timeline,omitempty"`
	CommitTime *time.Time `json:"commit_time,omitempty"`
	// RecoverySince is set while a recovery of the lost slot (see
	// --on-slot-lost) has not finished: events committed after it may be
	// missing from Kafka until it does.
	RecoverySince *time.Time `json:"recovery_since,omitempty"`
	WrittenAt     *time.Time `json:"written_at,omitempty"`
	// AgeSeconds is how long ago the stored position was written (0 when
	// it was only read).
	AgeSeconds float64 `json:"age_seconds"`
	// StartSource says whether the last start used the slot's position or
	// the progress record; StartLSN is where it started.
	StartSource string `json:"last_start_source,omitempty"`
	StartLSN    string `json:"last_start_lsn,omitempty"`
}

// resume decides where a session starts from the slot's confirmed position
// and the progress record; see decideStart. It opens the progress topic on
// first use (creating it if missing) and starts the writer.
func (p *progressKeeper) resume(ctx context.Context, slot replication.SlotStart, sys replication.System) (lsn.LSN, error) {
	slotStart := slot.LSN
	ctx, cancel := context.WithTimeout(ctx, progressTimeout)
	defer cancel()
	store, err := p.open(ctx)
	if err != nil {
		return 0, err
	}
	key := progress.Key(p.cfg.Replication.Slot, sys.ID)
	p.mu.Lock()
	reset := p.cfg.Progress.Reset && !p.resetDone
	p.mu.Unlock()
	rec, found, err := store.Latest(ctx, key)
	if errors.Is(err, progress.ErrTopicMissing) {
		rec, found, err = p.remakeTopic(ctx, store, key)
	}
	if reset && errors.Is(err, progress.ErrBadRecord) {
		// The reset overwrites it below; it need not decode.
		p.log.Warn().Err(err).Msg("--reset-progress: ignoring a progress record that cannot be used")
		rec, found, err = progress.Record{}, false, nil
	}
	if err != nil {
		return 0, badRecordAdvice(err)
	}
	var stored *progress.Record
	if found {
		stored = &rec
	}
	if found && !rec.RecoverySince.IsZero() && !reset {
		since := rec.RecoverySince.UTC().Format(time.RFC3339)
		return 0, fmt.Errorf("%w: the progress record marks a recovery of the lost slot that began and did not finish, so events committed after %s may be missing from Kafka. "+
			"Start with --on-slot-lost recover (or once with --existing-rows pending, which compares the whole table) to finish it; or republish by hand with `outbox-relay reconcile --since %s --until 0s --republish` (run's connection flags: the slot the recovery made exists already, so nothing written meanwhile is missed) and then start once with --reset-progress, which clears the mark",
			ErrRecoveryUnfinished, since, since)
	}
	d, err := decideStart(slotStart, slot.Created, stored, sys, reset)
	if err != nil {
		return 0, err
	}
	log := p.log.With().Str("system_id", sys.ID).Uint32("timeline", sys.Timeline).
		Str("slot_lsn", slotStart.String()).Str("start_lsn", d.Start.String()).Str("start_source", d.Source).Logger()
	if found {
		log = log.With().Str("progress_lsn", rec.LSN.String()).Uint32("progress_timeline", rec.Timeline).Logger()
	}
	if d.OrphanTo != 0 {
		p.metrics.orphaned(d.OrphanFrom, d.OrphanTo)
		log.Warn().Str("orphaned_from_lsn", d.OrphanFrom.String()).Str("orphaned_to_lsn", d.OrphanTo.String()).
			Uint64("orphaned_wal_bytes", uint64(d.OrphanTo-d.OrphanFrom)).
			Msg("the progress record comes from an earlier timeline that went on past the point where this server branched off (a failover): events the old primary published in that WAL range may be in Kafka without existing in this database; consumers may see them, and they will not be published again")
	}
	if d.GapTo != 0 {
		p.metrics.SlotGaps.Inc()
		ev := log.Error().Str("gap_from_lsn", d.GapFrom.String()).Str("gap_to_lsn", d.GapTo.String())
		const gap = "the slot was created now, after the position Kafka holds for it: events committed between the two were never streamed and may be missing from Kafka (the slot was dropped, or this is a server it was not synced to). "
		if !p.cfg.Replication.ReadsTable() {
			since := "the position Kafka holds"
			if !rec.CommitTime.IsZero() {
				ev = ev.Time("gap_from_commit_time", rec.CommitTime)
				since = rec.CommitTime.UTC().Format(time.RFC3339)
			}
			ev.Msg(gap + p.cfg.Replication.GapAdvice(since))
		} else {
			if !rec.CommitTime.IsZero() {
				ev = ev.Time("gap_from_commit_time", rec.CommitTime).Str("reconcile_command", reconcileCommand(rec.CommitTime, time.Now()))
			}
			ev.Msg(gap + "Run the reconcile_command to find and republish them")
		}
	}
	if reset {
		// Overwrite the record now: otherwise every later session of this
		// process would meet the same record and stop again.
		if err := store.Write(key, progress.Record{LSN: d.Start, Timeline: sys.Timeline, RelayVersion: p.cfg.Progress.RelayVersion, Delivery: p.cfg.DeliveryMode()}); err != nil {
			return 0, err
		}
		ev := log.Warn()
		if d.Ignored != "" {
			ev = ev.Str("ignored", d.Ignored)
		}
		ev.Msg("--reset-progress: starting from the slot's position and overwriting the stored progress; this happens once per process")
	} else {
		log.Info().Msg("start position decided")
	}
	p.mu.Lock()
	p.resetDone = p.resetDone || reset
	p.key, p.timeline = key, sys.Timeline
	p.report.StartSource, p.report.StartLSN = d.Source, d.Start.String()
	if found && p.report.WrittenAt == nil {
		p.noteRecord(rec)
	}
	p.mu.Unlock()
	p.metrics.started(d.Source)
	return d.Start, nil
}

// writeNow stores rec for key at once, after every position offered
// before: no older record the writer still holds can overwrite it.
func (p *progressKeeper) writeNow(ctx context.Context, key []byte, rec progress.Record) error {
	p.mu.Lock()
	store, writer := p.store, p.writer
	p.mu.Unlock()
	if store == nil {
		return errors.New("the progress topic is not open")
	}
	ctx, cancel := context.WithTimeout(ctx, progressTimeout)
	defer cancel()
	if writer != nil {
		if err := writer.Flush(ctx); err != nil {
			return err
		}
	}
	if _, err := await.Do(ctx, func() (struct{}, error) { return struct{}{}, store.Write(key, rec) }, func(struct{}) {}); err != nil {
		return err
	}
	p.written(rec)
	return nil
}

// remakeTopic answers a progress topic the brokers lost while this
// process ran (deleted, or gone with a broker's data): the store was opened
// by an earlier session, so nothing else would make it again, and every
// later session would stop on it. It makes the topic again and reads it once
// more. The slot stays the authority on where to start, and the record only
// ever moves that point forward: without a record the session starts from
// the slot, and re-delivers what came after it.
func (p *progressKeeper) remakeTopic(ctx context.Context, store progress.Store, key []byte) (progress.Record, bool, error) {
	created, err := store.Recreate(ctx)
	if err != nil {
		return progress.Record{}, false, fmt.Errorf("make the missing progress topic again: %w", err)
	}
	if created {
		msg := "the progress topic was missing on the brokers (deleted, or lost with a broker's data); made it again. This session starts from the slot's confirmed position, and events after it are re-delivered"
		if p.cfg.exactlyOnce() {
			msg = "the progress topic was missing on the brokers (deleted, or lost with a broker's data); made it again. This session starts from the slot's confirmed position: events after it that Kafka had already committed are sent again, and read_committed consumers may see those twice (dedupe by event_id)"
		}
		p.log.Warn().Str("topic", store.Topic()).Msg(msg)
	} else {
		p.log.Info().Str("topic", store.Topic()).Msg("the progress topic was missing on a broker that had just restarted, and exists again; reading it once more")
	}
	return store.Latest(ctx, key)
}

// open opens the store and its writer on first use. Only the session loop
// calls it, one session at a time; the lock is not held while Kafka
// answers, so /slot never waits on a slow broker.
func (p *progressKeeper) open(ctx context.Context) (progress.Store, error) {
	p.mu.Lock()
	store := p.store
	p.mu.Unlock()
	if store != nil {
		return store, nil
	}
	store, err := await.Do(ctx, func() (progress.Store, error) { return p.cfg.Sinks.OpenProgress(ctx, p.cfg.Progress.Topic, true) },
		func(s progress.Store) { s.Close() })
	if err != nil {
		return nil, err
	}
	var writer *progress.Writer
	if !p.cfg.exactlyOnce() {
		// In exactly-once mode the record goes into each Kafka
		// transaction instead.
		writer = progress.NewWriter(store, p.cfg.StatusInterval, p.log, p.written)
	}
	p.mu.Lock()
	p.store, p.writer = store, writer
	p.report.Topic = store.Topic()
	p.mu.Unlock()
	return store, nil
}

// written takes a record Kafka stored, where it was stored: from the
// at-least-once writer's goroutine, or from exactlyOnce once the Kafka
// transaction that carried it committed.
func (p *progressKeeper) written(rec progress.Record) {
	p.mu.Lock()
	p.noteRecord(rec)
	now := time.Now()
	p.report.WrittenAt = &now
	p.mu.Unlock()
	p.metrics.written(rec, now)
}

func (p *progressKeeper) noteRecord(rec progress.Record) {
	p.report.LSN, p.report.Timeline = rec.LSN.String(), rec.Timeline
	p.report.CommitTime, p.report.RecoverySince = timeOrNil(rec.CommitTime), timeOrNil(rec.RecoverySince)
}

// timeOrNil is t for a JSON report, nil (left out) when t is zero.
func timeOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// feed is the at-least-once writer's part in the session resume just
// started; nil in exactly-once mode, where Kafka transactions carry the
// record, or before a start decided the key.
func (p *progressKeeper) feed() *progressFeed {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.writer == nil || p.key == nil {
		return nil
	}
	feed := &progressFeed{writer: p.writer, key: p.key, timeline: p.timeline, relayVersion: p.cfg.Progress.RelayVersion}
	if c := p.report.CommitTime; c != nil {
		feed.lastCommit = *c
	}
	return feed
}

// txnProgress is the progress record the Kafka transactions of the session
// resume just started carry.
func (p *progressKeeper) txnProgress() txnProgress {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.store == nil {
		return txnProgress{}
	}
	return txnProgress{topic: p.store.Topic(), key: p.key, timeline: p.timeline, relayVersion: p.cfg.Progress.RelayVersion}.withRecord()
}

// progressFeed is how a session's read loop hands the at-least-once
// progress writer each position the tracker confirms, and learns what it
// stored: the position goes straight to the writer, with nothing in
// between.
type progressFeed struct {
	writer       *progress.Writer
	key          []byte
	timeline     uint32
	relayVersion string
	// lastCommit is the commit time of the newest record known when the
	// session started: an idle confirmation before the session confirms a
	// transaction of its own still names the last commit Kafka holds,
	// which a recovery of a lost slot starts its window from.
	lastCommit time.Time
}

// offer hands the writer a position the tracker confirmed: every event of
// every transaction ending at or before it was acknowledged by Kafka, and
// an idle confirmation (a keepalive's WAL end with nothing in flight and
// no transaction open) has no unacknowledged event before it either. So
// the record never leads what Kafka holds. The writer decides when to
// write; this never blocks the WAL reader. A nil feed offers nothing.
func (f *progressFeed) offer(confirmed lsn.LSN, commitTime time.Time) {
	if f == nil || confirmed == 0 {
		return
	}
	if commitTime.IsZero() {
		commitTime = f.lastCommit
	}
	f.writer.Offer(f.key, progress.Record{LSN: confirmed, Timeline: f.timeline, CommitTime: commitTime, RelayVersion: f.relayVersion, Delivery: DeliveryAtLeastOnce})
}

// close writes the last offered position and closes the store.
func (p *progressKeeper) close() {
	p.mu.Lock()
	w, store := p.writer, p.store
	p.writer, p.store = nil, nil
	p.mu.Unlock()
	if w != nil {
		w.Close(10 * time.Second)
	}
	if store != nil {
		store.Close()
	}
}

// status is the progress part of Status.
func (p *progressKeeper) status() *ProgressStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.report.Topic == "" {
		return nil
	}
	s := p.report
	if s.WrittenAt != nil {
		s.AgeSeconds = time.Since(*s.WrittenAt).Seconds()
	}
	return &s
}

// lastCommit is the commit time of the newest record stored or read; zero
// when none is known.
func (p *progressKeeper) lastCommit() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c := p.report.CommitTime; c != nil {
		return *c
	}
	return time.Time{}
}

// ProgressReport is what `status` shows of the progress topic, read
// without a running relay.
type ProgressReport struct {
	Topic      string     `json:"topic"`
	SystemID   string     `json:"system_id"`
	Timeline   uint32     `json:"server_timeline"`
	LSN        string     `json:"lsn,omitempty"`
	RecordTLI  uint32     `json:"timeline,omitempty"`
	CommitTime *time.Time `json:"commit_time,omitempty"`
	// WrittenBy is the delivery mode of the relay that wrote the record.
	// In exactly-once mode the record is committed in the same Kafka
	// transaction as the events it covers: LSN is the last committed
	// progress.
	WrittenBy string `json:"written_by_delivery,omitempty"`
	// RecoverySince is set while a recovery of the lost slot has not
	// finished (see ProgressStatus).
	RecoverySince *time.Time `json:"recovery_since,omitempty"`
	// AgeSeconds is the age of the record's commit time.
	AgeSeconds float64 `json:"age_seconds,omitempty"`
	// NextStartSource is what a relay starting now would start from, or
	// why it would stop.
	NextStartSource string `json:"next_start_source"`
	NextStartLSN    string `json:"next_start_lsn,omitempty"`
	Error           string `json:"error,omitempty"`
}

// ReadProgress reads the progress record for the slot and says where a
// relay starting now would start. It creates nothing. Kafka's part ends
// within --kafka-timeout.
func ReadProgress(ctx context.Context, cfg Config, slotStart lsn.LSN) (*ProgressReport, error) {
	pgCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	sys, err := replication.IdentifySystem(pgCtx, cfg.Replication)
	if err != nil {
		return nil, err
	}
	rep := &ProgressReport{Topic: cfg.Progress.Topic, SystemID: sys.ID, Timeline: sys.Timeline}
	rec, found, err := cfg.Sinks.ReadProgress(ctx, cfg.Progress.Topic, progress.Key(cfg.Replication.Slot, sys.ID))
	if errors.Is(err, progress.ErrTopic) {
		rep.NextStartSource, rep.NextStartLSN = StartFromSlot, slotStart.String()
		rep.Error = err.Error()
		return rep, nil
	}
	if err != nil {
		return nil, err
	}
	var stored *progress.Record
	if found {
		stored = &rec
		rep.LSN, rep.RecordTLI, rep.WrittenBy = rec.LSN.String(), rec.Timeline, rec.Delivery
		rep.CommitTime, rep.RecoverySince = timeOrNil(rec.CommitTime), timeOrNil(rec.RecoverySince)
		if rep.CommitTime != nil {
			rep.AgeSeconds = time.Since(rec.CommitTime).Seconds()
		}
	}
	d, err := decideStart(slotStart, false, stored, sys, false)
	if err != nil {
		rep.NextStartSource, rep.Error = "none", err.Error()
		return rep, nil
	}
	rep.NextStartSource, rep.NextStartLSN = d.Source, d.Start.String()
	return rep, nil
}

// isProgressFatal reports the progress errors retrying cannot fix.
func isProgressFatal(err error) bool {
	return errors.Is(err, ErrProgressAhead) || errors.Is(err, ErrRecoveryUnfinished) || errors.Is(err, progress.ErrTopic) || errors.Is(err, progress.ErrBadRecord)
}
