package poll

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/engine"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/store"
)

// Poll strategies (--poll-strategy).
const (
	// StrategyLease claims rows from the state table beside the outbox,
	// with leases, so several pollers share a table.
	StrategyLease = "lease"
	// StrategySnapshot reads rows by transaction snapshots, as Skytools'
	// PgQ does: each row records its transaction's id, and a batch is the
	// rows of the transactions that became visible between the last
	// snapshot published and a new one. One poller at a time (an advisory
	// lock); nothing is written per event, and the progress is one row.
	StrategySnapshot = "snapshot"
)

// snapshotLock is the advisory lock the active snapshot poller of a table
// holds on its progress connection: a second poller waits for it, and
// takes over within a second of the first one's session ending.
const snapshotLock = "SELECT pg_try_advisory_lock(hashtext('outbox-relay poll snapshot'), hashtext($1))"

// snapshotSettings are the reading connection's: the window's rows are
// sorted once per window, in memory when they fit.
const snapshotSettings = "SET work_mem = '64MB'"

// snapshotSession is one session of the snapshot strategy: the lock and
// the progress on one connection, the reads on another.
func (p *Poller) snapshotSession(ctx context.Context, batchLimit int) (polled bool, err error) {
	ctl, err := p.dial(ctx)
	if err != nil {
		return false, err
	}
	defer ctl.Close(context.Background())
	q, err := newSnapQueries(ctx, ctl, p.t, p.cfg.Postgres.OutboxLayout())
	if err != nil {
		return false, err
	}
	if err := p.checkStart(ctx, ctl); err != nil {
		return false, err
	}
	if p.cfg.DryRun == nil {
		// The shared poller lock too, active or standby, on the lock's
		// session: a WAL relay refuses to stream the table beside it, and
		// partitions adopt sees a standby, which holds nothing else.
		if err := pg.HoldPollerLock(ctx, ctl, p.cfg.Postgres); err != nil {
			return false, err
		}
		if err := p.lockSnapshot(ctx, ctl); err != nil || ctx.Err() != nil {
			return false, err
		}
	}
	if left, err := leaseTriggerLeft(ctx, ctl, p.t); err != nil {
		return false, err
	} else if left {
		p.log.Warn().Str("table", p.t.outbox.String()).
			Msg("the lease strategy's trigger still writes a state row per event, which the snapshot strategy does not read: once no lease poller runs, drop it (DROP TRIGGER ... ON the outbox table; see docs/poll-snapshot.md)")
	}
	progress, err := readSnapProgress(ctx, ctl, p.t)
	if err != nil {
		return false, err
	}
	if p.cfg.DryRun != nil && p.dryRunProgress != nil {
		progress = *p.dryRunProgress // a dry run never stored what it printed
	}
	read, err := p.dial(ctx)
	if err != nil {
		return false, err
	}
	defer read.Close(context.Background())
	if _, err := read.Exec(ctx, snapshotSettings); err != nil {
		return false, fmt.Errorf("set the reading session's settings: %w", err)
	}
	wake, listenErr, stopListening, err := p.startListening(ctx)
	if err != nil {
		return false, err
	}
	defer stopListening()
	readCtx, stopReads := context.WithCancel(ctx)
	defer stopReads()
	reader := &snapReader{conn: read, q: q, batch: p.cfg.Batch, pos: progress, bytes: pageBytes(p.cfg.MaxInFlightBytes, snapshotPagesHeld),
		maxMessage: int64(p.cfg.MaxMessageBytes)}
	reader.inline = max(reader.bytes/int64(reader.batch), 1)
	q.setInline(reader.inline)
	src := &snapSource{p: p, ctl: ctl, stored: progress, storedAt: time.Now(), provedAt: time.Now(), readCtx: readCtx, stopReads: stopReads,
		reader: reader, wake: wake, listenErr: listenErr}
	loopCfg := engine.Config{Log: p.log, Metrics: p.metrics.Metrics, ShutdownTimeout: p.cfg.ShutdownTimeout, MaxAttempts: p.cfg.MaxAttempts,
		HaltOnPermanent: p.cfg.OnPermanentError == pipeline.OnPermanentHalt}
	if p.cfg.DryRun != nil {
		src.dryRun = true
		if p.cfg.OnPermanentError == pipeline.OnPermanentQuarantine {
			// Under halt, the dry run stops where the poller would.
			loopCfg.Quarantine = engine.NewQuarantiner("the dry run's output", p.cfg.DryRun, p.cfg.Batch+2,
				"dry run: the poller would quarantine this event (printed on stdout, written nowhere)")
		}
		loopCfg.MaxAttempts = 0
		snk, err := p.cfg.DryRun.NewSink()
		if err != nil {
			return false, err
		}
		defer snk.Close(p.cfg.ShutdownTimeout)
		p.startSnapshot(progress)
		return true, engine.New(loopCfg, src, snk).Run(ctx)
	}
	qstore, err := store.OpenQuarantine(ctx, p.cfg.Postgres, p.t.quarantine, store.ForRelay)
	if err != nil {
		return false, err
	}
	defer qstore.Close()
	loopCfg.Quarantine = engine.NewQuarantiner(qstore.Table().String(), qstore, p.cfg.Batch+2, snapshotQuarantined)
	houseErr := make(chan error, 1)
	houseCtx, stopHousekeeping := context.WithCancel(ctx)
	housekeeping, err := p.housekeep(houseCtx, houseErr, func(conn *pgx.Conn) chores {
		return chores{stats: func(ctx context.Context) error {
			if err := checkStamp(ctx, conn, p.t); err != nil {
				return err
			}
			if err := p.snapshotGauges(ctx, conn, q); err != nil {
				return err
			}
			return p.countQuarantined(ctx, qstore)
		},
			retain: func(ctx context.Context) error { return p.snapshotRetain(ctx, conn) }}
	})
	if err != nil {
		stopHousekeeping()
		return false, err
	}
	defer func() {
		stopHousekeeping()
		<-housekeeping
	}()
	src.houseErr = houseErr
	pub, err := p.cfg.Sinks.NewBounded(batchLimit, true)
	if err != nil {
		return true, err
	}
	p.startSnapshot(progress)
	return true, engine.New(loopCfg, src, pub).Run(ctx)
}

// snapshotQuarantined is what the log says of each event quarantined.
const snapshotQuarantined = "event quarantined: the later events of its aggregate go on, as on the WAL path; `outbox-relay quarantine replay` delivers it"

// startSnapshot reports the session polling.
func (p *Poller) startSnapshot(progress snapProgress) {
	p.setState(pipeline.StatePolling, nil)
	p.hooks.Running()
	ev := p.log.Info().Str("table", p.t.outbox.String()).Str("progress_table", p.t.snapshot.String()).Str("strategy", StrategySnapshot).
		Int("batch", p.cfg.Batch).Bool("notify", p.cfg.Notify).Bool("existing_rows_first", progress.Existing)
	if progress.Window != "" {
		ev = ev.Int64("window_after_seq", progress.AfterSeq)
	}
	if p.cfg.DryRun != nil {
		ev.Msg("dry run: printing the records of the rows the snapshot strategy would publish next, then of new rows; nothing is published or recorded")
		return
	}
	ev.Msg("polling")
}

// lockSnapshot takes the table's snapshot lock on conn, waiting, as a
// standby, while another poller holds it.
func (p *Poller) lockSnapshot(ctx context.Context, conn *pgx.Conn) error {
	logged := false
	for {
		var ok bool
		if err := conn.QueryRow(ctx, snapshotLock, p.t.outbox.Quoted()).Scan(&ok); err != nil {
			return fmt.Errorf("take the snapshot strategy's lock: %w", err)
		}
		if ok {
			return nil
		}
		if !logged {
			p.setState(pipeline.StateWaitingForLock, nil)
			p.log.Info().Str("table", p.t.outbox.String()).
				Msg("another poller with --poll-strategy snapshot publishes this outbox table: waiting as its standby, to take over within a second of its session ending")
			logged = true
		}
		p.hooks.Alive()
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

// snapshotGauges reads how far the progress lags, how long the oldest
// transaction holding an id has been open, and the committed rows the
// stored progress does not cover yet (the backlog) with the oldest one's
// insert time.
func (p *Poller) snapshotGauges(ctx context.Context, conn *pgx.Conn, q *snapQueries) error {
	var lag, oldest float64
	var pending int64
	var oldestPending *time.Time
	err := conn.QueryRow(ctx, q.gauges).Scan(&lag, &oldest, &pending, &oldestPending)
	if err != nil {
		return fmt.Errorf("read the snapshot strategy's progress: %w", err)
	}
	now := time.Now()
	p.metrics.SnapshotLag.Set(max(lag, 0))
	p.metrics.SnapshotOldest.Set(max(oldest, 0))
	p.metrics.Pending.Set(float64(pending))
	age := 0.0
	if oldestPending != nil {
		age = max(now.Sub(*oldestPending).Seconds(), 0)
	}
	p.metrics.OldestPending.Set(age)
	g := SnapshotGauges{Pending: pending, OldestPendingInsertedAt: oldestPending, LagSeconds: max(lag, 0), OldestOpenTransactionSeconds: max(oldest, 0)}
	p.update(func(st *Status) { st.Snapshot, st.StatsReadAt = &g, &now })
	return nil
}

// SnapshotGauges is the snapshot strategy's state as /poll shows it, in
// its own words: it claims and leases nothing.
type SnapshotGauges struct {
	// Pending counts the committed rows the stored progress does not
	// cover yet.
	Pending                 int64      `json:"pending_rows"`
	OldestPendingInsertedAt *time.Time `json:"oldest_pending_inserted_at,omitempty"`
	// LagSeconds is how long ago the progress row last moved.
	LagSeconds float64 `json:"progress_lag_seconds"`
	// OldestOpenTransactionSeconds is how long the oldest open
	// transaction holding an id has been open; its rows wait for its
	// commit.
	OldestOpenTransactionSeconds float64 `json:"oldest_open_transaction_seconds"`
}

// snapshotRetain deletes rows inserted longer ago than the retention
// whose transactions the stored progress covers, in batches; rows from
// before the strategy only once they are published.
func (p *Poller) snapshotRetain(ctx context.Context, conn *pgx.Conn) error {
	l := p.cfg.Postgres.OutboxLayout()
	created, eventID := quoteIdent(l.Column(layout.CreatedAt)), quoteIdent(l.Column(layout.EventID))
	xid := quoteIdent(store.SnapshotXidColumn)
	cutoff := time.Now().Add(-p.cfg.Retention.After)
	covered := `o.` + created + ` < $1 AND (CASE WHEN o.` + xid + ` IS NULL THEN NOT s.existing_pending ELSE pg_visible_in_snapshot(o.` + xid + `, s.done) END)`
	from := p.t.outbox.Quoted() + " o, " + p.t.snapshot.Quoted() + " s"
	if p.cfg.Retention.DryRun {
		var count int64
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM "+from+" WHERE "+covered, cutoff).Scan(&count); err != nil {
			return fmt.Errorf("count the published rows of %s: %w", p.t.outbox, err)
		}
		if count > 0 {
			p.log.Info().Int64("rows", count).Time("created_before", cutoff).Msg("retention dry run: would delete these published rows")
		}
		return nil
	}
	var deleted int64
	for ctx.Err() == nil {
		tag, err := conn.Exec(ctx, "DELETE FROM "+p.t.outbox.Quoted()+" WHERE "+eventID+" IN (SELECT o."+eventID+" FROM "+from+" WHERE "+covered+" LIMIT $2)",
			cutoff, p.cfg.Retention.Batch)
		if err != nil {
			return fmt.Errorf("delete published rows of %s: %w", p.t.outbox, err)
		}
		n := tag.RowsAffected()
		deleted += n
		p.metrics.RetentionDeleted.Add(float64(n))
		if n < int64(p.cfg.Retention.Batch) {
			break
		}
	}
	p.metrics.RetentionRuns.Inc()
	if deleted > 0 {
		p.log.Info().Int64("rows", deleted).Time("created_before", cutoff).Msg("retention: deleted published rows")
	}
	return nil
}

// snapSource is the snapshot strategy's side of the engine loop: it reads
// one page of a window at a time, and stores the progress once the
// engine settled all of it. A page Kafka failed any event of ends the
// session; the next reads it again from the stored progress (its acked
// events are sent twice: re-delivery is bounded by one page).
type snapSource struct {
	p      *Poller
	ctl    *pgx.Conn
	reader *snapReader
	dryRun bool

	// stored is the progress row as last written; target is what it
	// becomes once the page in flight is settled.
	stored, target snapProgress
	rows           []snapRow
	events         []engine.Event
	base           engine.Position // the position of the page's first row
	next           engine.Position // base of the next page
	unsettled      int
	failed         int
	firstFailure   string

	wake      <-chan struct{}
	listenErr <-chan error
	houseErr  <-chan error
	// idle: the last read found nothing; the next waits for a wake-up or
	// the interval.
	idle     bool
	lastRead time.Time
	// storedAt is when the progress was last stored.
	storedAt time.Time
	// provedAt is when the last statement on ctl, the lock's session, was
	// sent that then succeeded: the server had heard from the session then,
	// so it could not have released the lock to a standby before
	// provedAt plus its own bound (ServerNoticesDeathSettings).
	provedAt time.Time

	// ahead brings the page read ahead, while one runs; readCtx ends with
	// the session (stopReads ends it sooner, at Close).
	ahead      chan snapPage
	readsAhead sync.WaitGroup
	readCtx    context.Context
	stopReads  context.CancelFunc
}

// Next takes the next page, once the one before is settled: the page read
// ahead while that one published, if any; else it reads at once while
// rows come, or after a notification (gathered for --poll-tick) or the
// interval.
//
// Every read runs on a goroutine of its own, so that the lock's session is
// proved alive every third of --pg-timeout whatever the reading
// connection does: a read behind a dead link would wait for ever.
func (s *snapSource) Next(ctx context.Context, deadline time.Time) (engine.Read, error) {
	if err := s.proveLock(); err != nil {
		return engine.Read{}, err
	}
	if !s.dryRun {
		if due := s.provedAt.Add(s.p.proofEvery()); due.Before(deadline) {
			deadline = due
		}
	}
	if s.ahead == nil {
		if s.idle && !s.waitForRows(ctx, deadline) {
			return engine.Read{}, nil
		}
		s.readAhead()
	}
	var page snapPage
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case page = <-s.ahead:
		s.ahead = nil
	case <-timer.C:
		return engine.Read{}, nil
	case <-ctx.Done():
		return engine.Read{}, nil
	}
	if page.err != nil {
		return engine.Read{}, page.err
	}
	rows := page.rows
	s.idle = len(rows) == 0
	s.target, s.rows, s.events = page.target, rows, s.events[:0]
	if len(rows) == 0 {
		// A window with no rows only moves Done: stored at most every
		// emptyStoreEvery, so an idle outbox in a busy database costs no
		// write a second. A restart then looks at those windows again.
		// The end of a window with rows (whose last page was full, so this
		// read found it ended) is stored at once: until then the stored
		// Done is the one from before the window, and every row of the
		// window, published or not, would count as pending.
		if s.target.Window == "" && s.stored.Window == "" && s.target.Existing == s.stored.Existing && time.Since(s.storedAt) < emptyStoreEvery {
			return engine.Read{}, nil
		}
		return engine.Read{}, s.store()
	}
	if err := s.proveLock(); err != nil {
		return engine.Read{}, err
	}
	s.base = s.next
	s.next += engine.Position(len(rows))
	for i := range rows {
		r := &rows[i]
		r.ev.Txn = s.base + engine.Position(i)
		e := engine.Event{Event: &r.ev, Attempts: 1 + s.p.failedAttempts[r.eventID]}
		if limit := s.p.cfg.MaxMessageBytes; r.size > int64(limit) {
			oversize(&e, r.size, limit, snapshotOversizeHeld)
		}
		s.events = append(s.events, e)
	}
	s.unsettled, s.failed, s.firstFailure = len(rows), 0, ""
	if page.more {
		s.readAhead() // a backlog: fetch the next page while this one publishes
	}
	return engine.Read{Events: s.events}, nil
}

// snapshotOversizeHeld is what the snapshot strategy does with an
// oversize row's aggregate, and how to go on.
const snapshotOversizeHeld = "the later events of its aggregate go on, as on the WAL path; once the limits are raised, republish it with `outbox-relay reconcile --republish` over its insert time"

// emptyStoreEvery bounds how often windows without rows are stored.
const emptyStoreEvery = 10 * time.Second

// snapPage is one read: its rows, the progress once they are in Kafka,
// and whether it took a new snapshot.
type snapPage struct {
	rows   []snapRow
	target snapProgress
	opened bool
	// more: the window, or the existing pass, has rows after these.
	more bool
	err  error
}

// read reads the next page and counts it.
func (s *snapSource) read(ctx context.Context) snapPage {
	s.p.hooks.Alive()
	s.lastRead = time.Now()
	var page snapPage
	page.rows, page.target, page.opened, page.more, page.err = s.reader.next(ctx)
	if page.err != nil {
		return page
	}
	readAt := s.lastRead
	s.p.update(func(st *Status) { st.LastReadAt = &readAt })
	s.p.metrics.observeClaim(len(page.rows))
	if page.opened {
		result := "rows"
		if len(page.rows) == 0 {
			result = "empty"
		}
		s.p.metrics.SnapshotWindows.WithLabelValues(result).Inc()
	}
	return page
}

// readAhead reads the next page on a goroutine of its own; Next takes it.
// The reader's connection is the goroutine's until then.
func (s *snapSource) readAhead() {
	ahead := make(chan snapPage, 1)
	s.ahead = ahead
	s.readsAhead.Add(1)
	go func() {
		defer s.readsAhead.Done()
		ahead <- s.read(s.readCtx)
	}()
}

// waitForRows waits for a notification, the interval since the last read,
// or deadline; it says whether to read now.
func (s *snapSource) waitForRows(ctx context.Context, deadline time.Time) bool {
	next := s.lastRead.Add(s.p.cfg.Interval)
	if !time.Now().Before(next) {
		return true
	}
	until := next
	if deadline.Before(until) {
		until = deadline
	}
	timer := time.NewTimer(time.Until(until))
	defer timer.Stop()
	select {
	case <-s.wake:
		// Commits that arrive together are read together.
		if err := s.p.gather(ctx, s.lastRead); err != nil {
			return false
		}
		return true
	case <-timer.C:
		return !time.Now().Before(next)
	case <-ctx.Done():
		return false
	}
}

// Sent: the source counts pages, not bytes.
func (s *snapSource) Sent(engine.Position, int) {}

// Settle counts a row's fate; once the page is settled, its progress is
// stored, or, if Kafka failed any row, the session ends.
func (s *snapSource) Settle(pos engine.Position, f engine.Fate) error {
	r := &s.rows[pos-s.base]
	switch {
	case f.Acked:
		s.p.metrics.observeAck(f.Delivery, r.created)
		s.p.settled(r.eventID)
	case f.Quarantined:
		s.p.settled(r.eventID)
	default:
		if f.Err != nil {
			s.p.failedAttempt(r.eventID)
		}
		if s.failed++; s.firstFailure == "" {
			s.firstFailure = "never sent"
			if f.Err != nil {
				s.firstFailure = f.Err.Error()
				if s.dryRun {
					return fmt.Errorf("%w: %s (--on-permanent-error halt); %s", errHalted, f.Err.Error(), f.Err.Advice())
				}
			}
		}
	}
	if s.unsettled--; s.unsettled > 0 {
		return nil
	}
	now := time.Now()
	s.p.update(func(st *Status) { st.LastAckAt = &now })
	if s.failed > 0 {
		return fmt.Errorf("kafka failed %d of the page's %d events (first: %s): the session ends, and the next sends the page again from the stored progress (its acknowledged events twice)",
			s.failed, len(s.rows), s.firstFailure)
	}
	return s.store()
}

// store writes the target progress once it differs from the stored one.
func (s *snapSource) store() error {
	if s.target == s.stored {
		return nil
	}
	if s.dryRun {
		p := s.target
		s.p.dryRunProgress, s.stored = &p, p
		return nil
	}
	// A one-row write, bounded as a proof of the lock's session is: it is
	// one.
	bound := s.p.proofEvery()
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	sent := time.Now()
	if err := writeSnapProgress(ctx, s.ctl, s.p.t, s.target); err != nil {
		if timedOut(err) {
			return s.lockDead(bound, err)
		}
		return err
	}
	s.stored, s.storedAt, s.provedAt = s.target, time.Now(), sent
	return nil
}

// ErrLockUnproven ends a snapshot poller's session that could not show
// its lock's session alive before publishing a page.
var ErrLockUnproven = errors.New("the poller could not prove it still holds its lock")

// proveLock asks ctl for an answer unless one came within a third of
// --pg-timeout. A page goes to Kafka only after that: a session that died
// unnoticed (its connection black-holed) may have let the server release
// the lock to a standby, and two pollers would publish at once.
func (s *snapSource) proveLock() error {
	if s.dryRun {
		return nil
	}
	every := s.p.proofEvery()
	if time.Since(s.provedAt) < every {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), every)
	defer cancel()
	sent := time.Now()
	if _, err := s.ctl.Exec(ctx, "SELECT 1"); err != nil {
		return s.lockDead(every, err)
	}
	s.provedAt = sent
	return nil
}

// lockDead is the error that ends the session when the lock's session
// gave no answer within bound.
func (s *snapSource) lockDead(bound time.Duration, err error) error {
	e := fmt.Errorf("%w: the poller's lock session had no answer within %s (%w); taking it for dead (a NAT, load balancer, proxy or firewall that dropped it, or a failed host) and connecting again (--pg-timeout %s bounds this wait); publishing stops first, so a standby that takes the lock once PostgreSQL notices the session gone publishes alone",
		ErrLockUnproven, bound, err, s.p.deadAfter())
	s.p.setState(pipeline.StateBackingOff, e)
	return e
}

// Duties reports the listener's and the housekeeping's failures.
// While a page publishes, the lock's session is proved alive as while
// reading.
func (s *snapSource) Duties(bool) error {
	if s.unsettled > 0 {
		if err := s.proveLock(); err != nil {
			return err
		}
	}
	select {
	case err := <-s.listenErr:
		return fmt.Errorf("listen for new rows: %w", err)
	case err := <-s.houseErr:
		return err
	default:
		return nil
	}
}

// Wake: as the lease strategy's flow, nothing is due on time while idle.
func (s *snapSource) Wake() time.Time {
	if s.unsettled == 0 {
		return time.Now().Add(time.Hour)
	}
	return time.Now().Add(time.Second)
}

// Full: one page publishes at a time, so its progress is stored before
// the next is read.
func (s *snapSource) Full() bool { return s.unsettled > 0 }

// InTransaction: a page is not a transaction; a stop sends no more of it.
func (s *snapSource) InTransaction() bool { return false }

// Close ends a read ahead, then the reader's open cursor.
func (s *snapSource) Close(bool) {
	s.stopReads()
	s.readsAhead.Wait()
	s.reader.close()
}

// failedAttempt counts a failed attempt of an event, for --max-attempts:
// the next read of its page sends it as attempt count+1. Only events of a
// failed page are counted, so the map is empty while Kafka takes
// everything and costs each event one lookup.
func (p *Poller) failedAttempt(eventID string) {
	if p.failedAttempts == nil {
		p.failedAttempts = map[string]int{}
	}
	p.failedAttempts[eventID]++
}

// settled drops an event's count once it is acked or quarantined.
func (p *Poller) settled(eventID string) {
	if len(p.failedAttempts) > 0 {
		delete(p.failedAttempts, eventID)
	}
}

// snapReader reads pages of windows through a cursor, on a connection of
// its own: a window's rows are sorted once, by their keys and sizes alone,
// and its pages are fetched from the sorted result while the previous
// page publishes; a page is cut to --poll-batch rows and to its byte
// bound, and only then are its rows' values read. pos is where it has
// read to, ahead of the stored progress by the page in flight.
type snapReader struct {
	conn  *pgx.Conn
	q     *snapQueries
	batch int
	// bytes bounds a page's values; maxMessage is --max-message-bytes, over
	// which a row's values are never read.
	bytes      int64
	maxMessage int64
	// inline is the largest row whose values the cursor brings with its
	// key: a FETCH of batch such rows is within bytes.
	inline int64
	pos    snapProgress
	tx     pgx.Tx // the open cursor's transaction; nil: none open
	// keys are the rows fetched from the cursor and not yet in a page.
	keys []snapKey
}

// snapCursor is the cursor's name, one per reading connection.
const snapCursor = "outbox_relay_window"

// next reads the next page, and returns the progress that holds once its
// rows are in Kafka. opened says it took a new snapshot; no rows then
// means no transaction with rows committed since the last one. more says
// the window or the existing pass has rows left: a backlog.
func (r *snapReader) next(ctx context.Context) (rows []snapRow, after snapProgress, opened, more bool, err error) {
	if len(r.keys) == 0 && r.tx == nil {
		if opened, err = r.open(ctx); err != nil || (opened && r.tx == nil) {
			return nil, r.pos, opened, false, err
		}
	}
	if len(r.keys) == 0 {
		if r.keys, err = r.fetch(ctx); err != nil {
			r.close()
			return nil, r.pos, opened, false, err
		}
		if len(r.keys) < r.batch {
			if err := r.tx.Commit(ctx); err != nil {
				r.close()
				return nil, r.pos, opened, false, fmt.Errorf("end the window's read: %w", err)
			}
			r.tx = nil
		}
	}
	if rows, err = r.values(ctx, r.take()); err != nil {
		r.close()
		return nil, r.pos, opened, false, err
	}
	more = r.tx != nil || len(r.keys) > 0
	switch {
	case r.pos.Existing && !more:
		r.pos.Existing, r.pos.ExistingAfterCreated, r.pos.ExistingAfterID, r.pos.ExistingAfterSeq = false, time.Time{}, "", 0
	case r.pos.Existing:
		end := rows[len(rows)-1]
		r.pos.ExistingAfterCreated, r.pos.ExistingAfterID, r.pos.ExistingAfterSeq = end.created, end.eventID, end.seq
	case !more:
		r.pos.Done, r.pos.Window, r.pos.AfterSeq = r.pos.Window, "", 0
	default:
		r.pos.AfterSeq = rows[len(rows)-1].seq
	}
	return rows, r.pos, opened, more, nil
}

// take cuts the next page from the keys fetched: up to --poll-batch rows
// whose values add up to its byte bound at most, and at least one row. A
// row over --max-message-bytes counts for nothing: its values are not
// read.
func (r *snapReader) take() []snapKey {
	n, used := 0, int64(0)
	for n < len(r.keys) && n < r.batch {
		size := r.keys[n].size
		if size > r.maxMessage {
			size = 0
		}
		if n > 0 && used+size > r.bytes {
			break
		}
		used += size
		n++
	}
	page := r.keys[:n:n]
	if r.keys = r.keys[n:]; len(r.keys) == 0 {
		r.keys = nil
	}
	return page
}

// open declares the cursor for the rows from before the strategy, for the
// window being read, or for a new window up to a snapshot taken now. It
// opens none when the new snapshot is the stored one: nothing committed.
func (r *snapReader) open(ctx context.Context) (opened bool, err error) {
	query, args := r.q.window, []any(nil)
	switch {
	case r.pos.Existing:
		if query, args, err = r.q.existingQuery(r.pos); err != nil {
			return false, err
		}
	case r.pos.Window == "":
		var now string
		if err := r.conn.QueryRow(ctx, "SELECT pg_current_snapshot()::text").Scan(&now); err != nil {
			return false, fmt.Errorf("take a snapshot: %w", err)
		}
		opened = true
		if now == r.pos.Done {
			return true, nil
		}
		r.pos.Window, r.pos.AfterSeq = now, 0
		fallthrough
	default:
		args = []any{r.pos.Done, r.pos.Window, r.pos.AfterSeq}
	}
	tx, err := r.conn.Begin(ctx)
	if err != nil {
		return opened, fmt.Errorf("begin the window's read: %w", err)
	}
	if _, err := tx.Exec(ctx, "DECLARE "+snapCursor+" NO SCROLL CURSOR FOR "+query, args...); err != nil {
		tx.Rollback(context.Background())
		return opened, fmt.Errorf("read the window's rows from %s: %w", r.q.t.outbox, err)
	}
	r.tx = tx
	return opened, nil
}

// fetch reads the cursor's next keys.
func (r *snapReader) fetch(ctx context.Context) ([]snapKey, error) {
	rows, err := r.tx.Query(ctx, fmt.Sprintf("FETCH %d FROM %s", r.batch, snapCursor))
	if err != nil {
		return nil, fmt.Errorf("read the window's rows from %s: %w", r.q.t.outbox, err)
	}
	defer rows.Close()
	out := make([]snapKey, 0, r.batch)
	for rows.Next() {
		k, err := scanSnapKey(rows, r.inline, r.q.layout, r.q.payloadBinary)
		if err != nil {
			return nil, err
		}
		out = append(out, k)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the window's rows from %s: %w", r.q.t.outbox, err)
	}
	return out, nil
}

// values returns a page's rows with their values: those the cursor
// brought, and those of the larger rows read now by ctid; a row over
// --max-message-bytes keeps only its identity.
func (r *snapReader) values(ctx context.Context, page []snapKey) ([]snapRow, error) {
	if len(page) == 0 {
		return nil, nil
	}
	out := make([]snapRow, len(page))
	var ctids, within []string
	var index map[string]int
	for i := range page {
		k := &page[i]
		out[i] = k.row
		if k.inline || k.size > r.maxMessage {
			continue
		}
		if index == nil {
			index = map[string]int{}
		}
		ctids, within, index[k.at] = append(ctids, k.ctid), append(within, k.at), i
	}
	if len(ctids) == 0 {
		return out, nil
	}
	rows, err := r.conn.Query(ctx, r.q.values, ctids, within)
	if err != nil {
		return nil, fmt.Errorf("read the page's rows from %s: %w", r.q.t.outbox, err)
	}
	defer rows.Close()
	wanted := len(index)
	for rows.Next() {
		at := string(rows.RawValues()[0])
		i, ok := index[at]
		if !ok {
			continue // another partition's row at the same ctid
		}
		if err := scanSnapValues(rows, 1, r.q.layout, r.q.payloadBinary, &out[i]); err != nil {
			return nil, err
		}
		delete(index, at)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the page's rows from %s: %w", r.q.t.outbox, err)
	}
	if len(index) > 0 {
		// Only retention deletes, and never a row the progress does not
		// cover; a row moves only when the table is rewritten.
		return nil, fmt.Errorf("%d of the page's %d rows of %s read by their place moved or vanished while the window was read (was the table rewritten, by VACUUM FULL or CLUSTER?): the session ends, and the next reads the window again",
			len(index), wanted, r.q.t.outbox)
	}
	return out, nil
}

// close ends an open cursor's transaction, and forgets the keys fetched.
func (r *snapReader) close() {
	if r.tx != nil {
		r.tx.Rollback(context.Background())
		r.tx = nil
	}
	r.keys = nil
}
