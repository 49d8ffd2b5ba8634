package poll

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/engine"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/store"
)

// notifyChannel is the channel the trigger notifies, with the outbox
// table's quoted name as the payload.
const notifyChannel = "outbox_relay_poll"

// Hooks are told of the poller's progress, for a supervisor such as
// systemd: Running each time a session starts polling, Alive while the
// poller's loops turn (at least every --poll-interval while polling, and
// every second of a backoff). Nil ones are skipped.
type Hooks = pipeline.Hooks

// Poller claims, publishes and marks outbox rows until its context ends.
type Poller struct {
	cfg     Config
	t       tables
	log     zerolog.Logger
	metrics *Metrics
	hooks   Hooks

	// dryRunAfter is the last row a dry run printed; only sessions, one
	// at a time, use it.
	dryRunAfter int64

	// dryRunProgress is where a snapshot dry run printed to.
	dryRunProgress *snapProgress

	// failedAttempts counts the snapshot strategy's failed attempts per
	// event id, for --max-attempts, across sessions. Only the engine's
	// goroutine of the one session running touches it.
	failedAttempts map[string]int

	mu     sync.Mutex
	status Status
}

// Status is the poller's own view, served on /poll beside Stats.
type Status struct {
	pipeline.Status
	WorkerID string `json:"worker_id,omitempty"`
	// Strategy is --poll-strategy: lease or snapshot.
	Strategy string `json:"strategy"`
	// LastClaimAt is when the lease strategy's last claim ran, empty or
	// not.
	LastClaimAt *time.Time `json:"last_claim_at,omitempty"`
	// LastReadAt is when the snapshot strategy last read a page of a
	// window, or looked for a new one; it claims nothing.
	LastReadAt *time.Time `json:"last_read_at,omitempty"`
	// LastAckAt is when Kafka last acknowledged a record of this poller.
	LastAckAt *time.Time `json:"last_ack_at,omitempty"`
	// Stats is the table's state as last read, every few seconds (the
	// lease strategy's; Snapshot is the snapshot strategy's).
	Stats       *Stats          `json:"stats,omitempty"`
	Snapshot    *SnapshotGauges `json:"snapshot,omitempty"`
	StatsReadAt *time.Time      `json:"stats_read_at,omitempty"`
}

// New returns a poller for a validated configuration.
func New(cfg Config, log zerolog.Logger, metrics *Metrics, hooks Hooks) (*Poller, error) {
	t, err := cfg.tables()
	if err != nil {
		return nil, err
	}
	for _, h := range []*func(){&hooks.Running, &hooks.Alive} {
		if *h == nil {
			*h = func() {}
		}
	}
	p := &Poller{cfg: cfg, t: t, log: log, metrics: metrics, hooks: hooks,
		status: Status{Status: pipeline.Status{State: pipeline.StateStarting}, Strategy: cfg.Strategy}}
	if cfg.Strategy != StrategySnapshot {
		// The snapshot strategy takes no leases to name a worker in.
		p.status.WorkerID = cfg.WorkerID
	}
	metrics.SetState(pipeline.StateStarting)
	return p, nil
}

// Status returns a copy of the poller's status.
func (p *Poller) Status() Status {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.status
}

func (p *Poller) setState(state pipeline.State, err error) {
	p.mu.Lock()
	p.status.Set(state, err, time.Now())
	p.mu.Unlock()
	p.metrics.SetState(state)
}

// Ready reports whether the poller polls, and why not.
func (p *Poller) Ready() (bool, string) {
	s := p.Status()
	if s.State != pipeline.StatePolling {
		return false, s.NotReady()
	}
	return true, ""
}

func (p *Poller) update(f func(s *Status)) {
	p.mu.Lock()
	f(&p.status)
	p.mu.Unlock()
}

// IsFatal reports whether err needs the operator, so retrying cannot help.
func IsFatal(err error) bool {
	return pipeline.IsFatal(err) || errors.Is(err, errHalted)
}

// errHalted marks a stop on a permanently refused event under
// --on-permanent-error halt.
var errHalted = errors.New("halted on an event Kafka refuses")

// Run polls until ctx ends (nil) or a fatal error. A failure of PostgreSQL
// or Kafka ends the session; the next starts after a backoff with jitter.
func (p *Poller) Run(ctx context.Context) error {
	loop := pipeline.Restarts{Source: pollSource{p}, Log: p.log, Clock: pipeline.WallClock{}, Metrics: p.metrics.Metrics,
		BackoffMin: p.cfg.RestartBackoffMin, BackoffMax: p.cfg.RestartBackoffMax, ResetAfter: p.cfg.RestartBackoffMax,
		BatchLimit: p.cfg.Sinks.MaxMessageBytes(), Alive: p.hooks.Alive}
	return loop.Run(ctx)
}

// pollSource is the poller's side of the restart loop.
type pollSource struct{ p *Poller }

func (s pollSource) Session(ctx context.Context, batchLimit int) (bool, error) {
	return s.p.session(ctx, batchLimit)
}

func (s pollSource) Fatal(err error) (error, bool) { return err, IsFatal(err) }

// Waiting: a poller never waits for another; pollers share the table.
func (pollSource) Waiting(error) (pipeline.State, string) { return "", "" }

func (pollSource) FailureMessage(bool) string { return "poll session failed; starting a new one" }

func (s pollSource) SetState(state pipeline.State, err error) { s.p.setState(state, err) }

// session is one connection to PostgreSQL and one producer, whose
// batches are at most batchLimit bytes. polled says it got as far as
// polling.
func (p *Poller) session(ctx context.Context, batchLimit int) (polled bool, err error) {
	if p.cfg.Strategy == StrategySnapshot {
		return p.snapshotSession(ctx, batchLimit)
	}
	if p.cfg.DryRun != nil {
		return p.dryRunSession(ctx, &p.dryRunAfter)
	}
	conn, err := p.dial(ctx)
	if err != nil {
		return false, err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, claimPlannerSettings); err != nil {
		return false, fmt.Errorf("set the claiming session's planner settings: %w", err)
	}
	q, err := newQueries(ctx, conn, p.t, p.cfg.Postgres.OutboxLayout(), p.cfg.WorkerID, p.cfg.SessionCheck)
	if err != nil {
		return false, err
	}
	if err := p.checkStart(ctx, conn); err != nil {
		return false, err
	}
	if p.cfg.SessionCheck {
		// On the claiming session: the lock lives exactly as long as the
		// leases this session takes stay valid.
		if err := pg.HoldPollerLock(ctx, conn, p.cfg.Postgres); err != nil {
			return false, err
		}
	}
	quarantine, err := store.OpenQuarantine(ctx, p.cfg.Postgres, p.t.quarantine, store.ForRelay)
	if err != nil {
		return false, err
	}
	defer quarantine.Close()
	if n, err := q.releaseOwn(ctx); err != nil {
		return false, err
	} else if n > 0 {
		p.log.Info().Int64("rows", n).Str("worker_id", p.cfg.WorkerID).Msg("released this poller's earlier leases")
	}
	wake, listenErr, stopListening, err := p.startListening(ctx)
	if err != nil {
		return false, err
	}
	defer stopListening()

	p.setState(pipeline.StatePolling, nil)
	p.hooks.Running()
	p.log.Info().Str("worker_id", p.cfg.WorkerID).Str("table", p.t.outbox.String()).Str("state_table", p.t.state.String()).
		Int("batch", p.cfg.Batch).Dur("lease", p.cfg.Lease).Bool("notify", p.cfg.Notify).Msg("polling")
	houseErr := make(chan error, 1)
	houseCtx, stopHousekeeping := context.WithCancel(ctx)
	housekeeping, err := p.housekeep(houseCtx, houseErr, func(conn *pgx.Conn) chores {
		q := p.queriesOn(conn)
		return chores{stats: func(ctx context.Context) error {
			if err := p.refreshStats(ctx, q); err != nil {
				return err
			}
			return p.countQuarantined(ctx, quarantine)
		},
			retain: func(ctx context.Context) error { return p.retain(ctx, q) }}
	})
	if err != nil {
		stopHousekeeping()
		return true, err
	}
	defer func() {
		stopHousekeeping()
		<-housekeeping
	}()
	marks, err := p.dial(ctx)
	if err != nil {
		return true, err
	}
	defer marks.Close(context.Background())
	// The lease strategy goes on with its sink after a failure: a failed
	// event backs off alone, and its aggregate's later rows wait for it.
	pub, err := p.cfg.Sinks.NewBounded(batchLimit, false)
	if err != nil {
		return true, err
	}
	w := &worker{p: p, claims: q, marks: p.queriesOn(marks), claimsAlive: p.newProver(conn, "claiming"),
		marksAlive: p.newProver(marks, "marks")}
	f := w.startFlow(ctx, func(ctx context.Context, f *flow) error {
		return p.claimLoop(ctx, w, f, wake, listenErr, houseErr)
	})
	loop := engine.New(engine.Config{
		Log: p.log, Metrics: p.metrics.Metrics, ShutdownTimeout: p.cfg.ShutdownTimeout, MaxAttempts: p.cfg.MaxAttempts,
		// The capacity covers the one batch the engine publishes at a time.
		Quarantine:      engine.NewQuarantiner(quarantine.Table().String(), quarantine, p.cfg.Batch+2, quarantineStored),
		HaltOnPermanent: p.cfg.OnPermanentError == pipeline.OnPermanentHalt,
	}, f, pub)
	return true, loop.Run(ctx)
}

// checkStart refuses to poll beside a WAL relay of the table, and checks
// what retention needs when it is on.
func (p *Poller) checkStart(ctx context.Context, conn *pgx.Conn) error {
	if err := pg.CheckNoWALRelay(ctx, conn, p.cfg.Postgres, p.cfg.Slot); err != nil {
		return err
	}
	if p.cfg.Retention.After > 0 {
		return pg.CheckRetention(ctx, conn, p.cfg.Postgres)
	}
	return nil
}

// claimLoop claims batches and hands them to the engine through f until
// ctx ends or a failure: at once while a backlog drains, else after the
// interval or a notification.
func (p *Poller) claimLoop(ctx context.Context, w *worker, f *flow, wake <-chan struct{}, listenErr, houseErr <-chan error) error {
	interval := time.NewTimer(p.cfg.Interval)
	defer interval.Stop()
	inFlight := 0 // batches handed over and not yet marked
	for {
		p.hooks.Alive()
		claimedAt := time.Now()
		// A claim made while a batch is in flight skips the rows behind
		// that batch's; they may be claimable once it is marked.
		overlapped := inFlight > 0
		rows, err := w.claim(ctx)
		if err != nil {
			return err
		}
		if len(rows) > 0 {
			if err := f.send(ctx, rows, &inFlight); err != nil {
				return err
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		select {
		case err := <-houseErr:
			return err
		default:
		}
		if w.full {
			continue // a backlog: claim again at once
		}
		if err := f.settle(ctx, &inFlight, houseErr); err != nil || ctx.Err() != nil {
			return err
		}
		if overlapped {
			continue
		}
		if !interval.Stop() {
			select {
			case <-interval.C:
			default:
			}
		}
		interval.Reset(p.cfg.Interval)
		// Under a --poll-interval longer than a third of --pg-timeout the
		// claiming session is proved alive in between.
		proof := proofTimer(w.claimsAlive)
		select {
		case <-proof.C:
			if err := w.claimsAlive.prove(ctx); err != nil {
				return err
			}
		case <-ctx.Done():
			return nil
		case <-wake:
			if err := p.gather(ctx, claimedAt); err != nil {
				return nil
			}
		case <-interval.C:
		case err := <-listenErr:
			return fmt.Errorf("listen for new rows: %w", err)
		case err := <-houseErr:
			return err
		}
		proof.Stop()
	}
}

// queriesOn returns the statements of a connection that claims nothing:
// marks, statistics and retention.
func (p *Poller) queriesOn(conn *pgx.Conn) *queries {
	return &queries{conn: conn, t: p.t, layout: p.cfg.Postgres.OutboxLayout(), workerID: p.cfg.WorkerID}
}

// plannerSettings are those the poller's statements are measured with.
// The claim is one prepared statement whose
// plan does not depend on its parameters; planning it anew for every claim
// cost more than running it (measured: 3 ms of planning for a 500-row
// claim). The unpublished rows the claim and the statistics read are in
// cache, so an index scan beats a scan of the whole state table, which the
// default random_page_cost chose: 25 ms against 6 at 100,000 rows. And
// with a large backlog the claim's estimated cost passes jit_above_cost:
// compiling it took 795 ms of each 880 ms claim at 780,000 pending rows,
// for a plan that runs in 30 ms.
const plannerSettings = "SET plan_cache_mode = force_generic_plan; SET random_page_cost = 1.1; SET jit = off"

// claimPlannerSettings are the claiming connection's own. The claim must
// read the pending rows in order and stop at its batch; the one other plan
// is to read every pending row through the aggregates' index and sort
// them, which the planner prefers whenever the table's statistics were
// taken while little was pending, the outbox's usual state. Its generic
// plan then keeps it until the next ANALYZE: measured, 1.7 s per claim of
// 500 rows on a 300,000-row backlog, against 14 ms. Without sorts there is
// no such plan (the final sort of the claimed rows has no alternative,
// so it stays).
const claimPlannerSettings = "SET enable_sort = off"

// dial opens a connection with plannerSettings.
func (p *Poller) dial(ctx context.Context) (*pgx.Conn, error) {
	conn, err := pg.Dial(ctx, p.cfg.Postgres)
	if err != nil {
		return nil, err
	}
	// The server side's bound too: a poller's sessions hold its advisory
	// locks and leases, which a standby waits on until the server notices
	// the session gone.
	if _, err := conn.Exec(ctx, plannerSettings+"; "+pg.ServerNoticesDeathSettings(p.cfg.Postgres.DeadAfter)); err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("set the session's planner settings: %w", err)
	}
	return conn, nil
}

// chores are a session's periodic work on the housekeeping connection:
// reading its statistics, and deleting old published rows.
type chores struct {
	stats, retain func(ctx context.Context) error
}

// housekeep runs the statistics and retention that chores makes for a
// connection of its own, so that neither holds up a read, until ctx ends.
// It reports a failure on errc, and closes done once its goroutine is
// done. A statistics read may cost a pass over the backlog, so while the
// backlog is large it runs less often: never more than a twentieth of the
// time.
func (p *Poller) housekeep(ctx context.Context, errc chan<- error, chores func(conn *pgx.Conn) chores) (done <-chan struct{}, err error) {
	conn, err := p.dial(ctx)
	if err != nil {
		return nil, err
	}
	work := chores(conn)
	alive := p.newProver(conn, "housekeeping")
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		defer conn.Close(context.Background())
		var nextStats, nextRetention time.Time
		timer := time.NewTimer(0)
		defer timer.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-timer.C:
			}
			now := time.Now()
			var err error
			if now.Before(nextStats) && (p.cfg.Retention.After <= 0 || now.Before(nextRetention)) {
				// Between chores the connection is proved alive.
				err = alive.prove(ctx)
			} else if !now.Before(nextStats) {
				err = work.stats(ctx)
				took := time.Since(now)
				nextStats = now.Add(max(p.cfg.StatsInterval, 20*took))
			}
			if err == nil && p.cfg.Retention.After > 0 && !now.Before(nextRetention) {
				err = work.retain(ctx)
				nextRetention = now.Add(p.cfg.Retention.Interval)
			}
			if err != nil {
				if ctx.Err() == nil {
					errc <- err
				}
				return
			}
			alive.proved(now) // a chore that succeeded proves it too
			next := nextStats
			if p.cfg.Retention.After > 0 && nextRetention.Before(next) {
				next = nextRetention
			}
			if due := alive.due(); due.Before(next) {
				next = due
			}
			timer.Reset(time.Until(next))
		}
	}()
	return stopped, nil
}

// gather waits, after a wake-up, until a tick has passed since the last
// claim began: the commits of that tick are then claimed together. It
// returns ctx's error if ctx ends first.
func (p *Poller) gather(ctx context.Context, lastClaim time.Time) error {
	wait := time.Until(lastClaim.Add(p.cfg.Tick))
	if wait <= 0 {
		return nil
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// startListening starts listen under --poll-notify: wake gets the
// wake-ups, errs its failure, and stop ends it and waits for it. Without
// --poll-notify nothing comes on either.
func (p *Poller) startListening(ctx context.Context) (wake <-chan struct{}, errs <-chan error, stop func(), err error) {
	wakeups, failures := make(chan struct{}, 1), make(chan error, 1)
	if !p.cfg.Notify {
		return wakeups, failures, func() {}, nil
	}
	listenCtx, stopListening := context.WithCancel(ctx)
	stopped, err := p.listen(listenCtx, wakeups, failures)
	if err != nil {
		stopListening()
		return nil, nil, nil, err
	}
	return wakeups, failures, func() {
		stopListening()
		<-stopped
	}, nil
}

// listen opens a connection of its own that waits for the trigger's
// notifications and turns those for this outbox table into wake-ups. It
// reports a failure on errc, and closes stopped once its goroutine is done.
func (p *Poller) listen(ctx context.Context, wake chan<- struct{}, errc chan<- error) (stopped <-chan struct{}, err error) {
	conn, err := pg.Dial(ctx, p.cfg.Postgres)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, "LISTEN "+notifyChannel); err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("listen on %s: %w", notifyChannel, err)
	}
	outbox := p.t.outbox.Quoted()
	alive := p.newProver(conn, "LISTEN")
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer conn.Close(context.Background())
		for {
			// A wait ends at least every third of --pg-timeout to prove
			// the connection alive: behind a dead link no notification
			// ever comes, and nothing else would tell. A wait its deadline
			// interrupts leaves the connection usable.
			waitCtx, cancel := context.WithDeadline(ctx, alive.due())
			n, err := conn.WaitForNotification(waitCtx)
			cancel()
			if err == nil {
				alive.proved(time.Now())
			}
			if err != nil && ctx.Err() == nil && timedOut(err) {
				err = alive.prove(ctx)
				if err == nil {
					continue
				}
			}
			if err != nil {
				if ctx.Err() == nil {
					errc <- err
				}
				return
			}
			if n.Payload != outbox {
				continue
			}
			select {
			case wake <- struct{}{}:
			default: // a wake-up is already waiting
			}
		}
	}()
	return done, nil
}

// refreshStats settles replayed events and reads the gauges' values.
func (p *Poller) refreshStats(ctx context.Context, q *queries) error {
	if n, err := q.settleReplayed(ctx); err != nil {
		return err
	} else if n > 0 {
		p.log.Info().Int64("events", n).Msg("quarantined events were replayed: their aggregates go on")
	}
	stats, err := ReadStats(ctx, q.conn, p.t.state)
	if err != nil {
		return err
	}
	now := time.Now()
	p.metrics.observeStats(stats, now)
	p.update(func(s *Status) { s.Stats, s.StatsReadAt = &stats, &now })
	return nil
}

// countQuarantined sets outbox_relay_quarantined_events from the
// quarantine table, as the WAL path does: the events in it that wait for
// a replay, for either strategy.
func (p *Poller) countQuarantined(ctx context.Context, q *store.Quarantine) error {
	n, err := q.Count(ctx)
	if err != nil {
		return err
	}
	p.metrics.Quarantined.Set(float64(n))
	return nil
}

// retain deletes the published rows inserted (--column-created-at) longer
// ago than the retention, the rule of every table source, after logging
// how many there are; under --retention-dry-run it only logs.
func (p *Poller) retain(ctx context.Context, q *queries) error {
	cutoff := time.Now().Add(-p.cfg.Retention.After)
	count, err := q.retainable(ctx, cutoff)
	if err != nil {
		return err
	}
	if count == 0 {
		return nil
	}
	if p.cfg.Retention.DryRun {
		p.log.Info().Int64("rows", count).Time("created_before", cutoff).Msg("retention dry run: would delete these published rows")
		return nil
	}
	p.log.Info().Int64("rows", count).Time("created_before", cutoff).Msg("retention: deleting published rows")
	var deleted int64
	for ctx.Err() == nil {
		n, err := q.deletePublished(ctx, cutoff, p.cfg.Retention.Batch)
		if err != nil {
			return err
		}
		deleted += n
		p.metrics.RetentionDeleted.Add(float64(n))
		if n < int64(p.cfg.Retention.Batch) {
			break
		}
	}
	p.metrics.RetentionRuns.Inc()
	p.log.Info().Int64("rows", deleted).Msg("retention: deleted published rows")
	return nil
}

// ReadStatus reads poll mode's state from PostgreSQL on a short-lived
// connection, for the status command: it needs no running poller.
func ReadStatus(ctx context.Context, cfg Config) (Stats, error) {
	t, err := cfg.tables()
	if err != nil {
		return Stats{}, err
	}
	conn, err := pg.Dial(ctx, cfg.Postgres)
	if err != nil {
		return Stats{}, err
	}
	defer conn.Close(context.Background())
	return ReadStats(ctx, conn, t.state)
}
