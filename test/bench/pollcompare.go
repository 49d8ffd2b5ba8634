package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/poll"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// PollResult is the "polling or CDC?" part: the relay's two sources, the
// WAL (a replication slot) and poll mode (a state table), on one
// PostgreSQL and one broker, measured side by side.
type PollResult struct {
	Method string     `json:"method"`
	Runs   []PollRun  `json:"runs"`
	Sizes  []PollSize `json:"sizes"`
	Idle   []PollIdle `json:"idle"`
}

// PollRun is one source in one phase: a steady commit rate or catch-up.
type PollRun struct {
	Source string `json:"source"` // wal or poll
	// Variant is the relay variant's name (--variant), empty for the default.
	Variant string `json:"variant,omitempty"`
	Broker  string `json:"broker"`
	Phase   string `json:"phase"` // "500/s", "2000/s", "catch-up"
	Rep     int    `json:"rep"`
	Events  int    `json:"events"`
	// Seconds runs from the first measured commit (catch-up: the relay's
	// start) until the independent consumer held the last record.
	Seconds      float64 `json:"seconds"`
	EventsPerSec float64 `json:"events_per_sec"`
	RateHeld     bool    `json:"rate_held,omitempty"`
	// P50Ms and P99Ms: commit to the independent consumer (steady only).
	P50Ms float64 `json:"p50_ms,omitempty"`
	P99Ms float64 `json:"p99_ms,omitempty"`
	// CPU per event: the relay process, and every PostgreSQL process (the
	// writers' backends, the walsender or the poller's sessions,
	// autovacuum and the background processes, exited ones included).
	RelayCPUUsPerEvent    float64 `json:"relay_cpu_us_per_event"`
	PostgresCPUUsPerEvent float64 `json:"postgres_cpu_us_per_event"`
	// WALBytesPerEvent is all WAL written over the span over its events:
	// steady runs include the writers' inserts (and poll mode's trigger);
	// catch-up counts only the relay's share, the backlog's own WAL is in
	// FillWALBytesPerEvent.
	WALBytesPerEvent     float64 `json:"wal_bytes_per_event"`
	FillWALBytesPerEvent float64 `json:"fill_wal_bytes_per_event,omitempty"`
	MachineBusyPercent   float64 `json:"machine_busy_percent"`
}

// PollSize is what a source's tables take once every event is published.
type PollSize struct {
	Source  string `json:"source"`
	Variant string `json:"variant,omitempty"`
	Broker  string `json:"broker"`
	Events  int64  `json:"events"`
	// Outbox and its indexes; State and its indexes (poll mode only).
	OutboxBytes      int64 `json:"outbox_bytes"`
	OutboxIndexBytes int64 `json:"outbox_index_bytes"`
	StateBytes       int64 `json:"state_bytes,omitempty"`
	StateIndexBytes  int64 `json:"state_index_bytes,omitempty"`
	// PendingIndexBytes is poll mode's partial index of unpublished rows;
	// for the snapshot strategy, the index of transaction ids on the
	// outbox (counted in OutboxIndexBytes too), and State its progress.
	PendingIndexBytes int64 `json:"pending_index_bytes,omitempty"`
	DeadTuples        int64 `json:"dead_tuples"`
	// ChangedOutsideOutbox counts the rows updated or deleted in tables
	// other than the outbox while the source ran: each leaves a dead tuple.
	ChangedOutsideOutbox int64 `json:"changed_outside_outbox"`
}

// PollIdle is what a source costs while nothing is written.
type PollIdle struct {
	Source          string  `json:"source"`
	Variant         string  `json:"variant,omitempty"`
	Broker          string  `json:"broker"`
	Seconds         float64 `json:"seconds"`
	RelayCPUMsPerS  float64 `json:"relay_cpu_ms_per_s"`
	PostgresCPUMsPS float64 `json:"postgres_cpu_ms_per_s"`
	WALBytesPerS    float64 `json:"wal_bytes_per_s"`
	// StatementsPerS is the transactions committed in the database per
	// second: poll mode's claims; the WAL path's slot and status queries.
	StatementsPerS float64 `json:"transactions_per_s"`
}

const pollMethod = "both sources on one PostgreSQL 15 (autovacuum on, fsync as the bench's) and one broker, a fresh database and topic each, in alternating order per repetition. " +
	"Steady: single-row transactions (synchronous_commit=on) on an open-loop schedule, after a warm-up; latency is commit to an independent franz-go consumer. " +
	"Catch-up: a backlog of 10-row transactions written with the relay stopped, then drained. PostgreSQL CPU is every server process, exited ones included (the postmaster's reaped children). " +
	"Poll mode runs with its defaults (batch 500, NOTIFY, 1 s fallback interval), with each strategy: poll is the lease strategy, poll-snapshot the snapshot strategy"

const messagesMethod = "the table source (the WAL path) and the messages source (pg_logical_emit_message, no outbox table) on one PostgreSQL 15 (autovacuum on, fsync as the bench's) and one broker, a fresh database and topic each, in alternating order per repetition; " +
	"the same events, the messages' content built by PostgreSQL as the writer library's Emit builds it. " +
	"Steady: single-event transactions (synchronous_commit=on) on an open-loop schedule, after a warm-up; latency is commit to an independent franz-go consumer. " +
	"Catch-up: a backlog of 10-event transactions written with the relay stopped, then drained. PostgreSQL CPU is every server process, exited ones included; WAL is every byte written over the span. " +
	"Rates, backlog and idle period are the poll part's (--poll-rates, --poll-rows, --poll-idle)"

// Poll mode's contenders in the poll part: the lease strategy (source
// "poll", as in every earlier result) and the snapshot strategy.
const (
	sourcePollLease    = "poll"
	sourcePollSnapshot = "poll-snapshot"
)

// pollStrategies are the poll part's sources that poll, by strategy.
var pollStrategies = map[string]string{sourcePollLease: poll.StrategyLease, sourcePollSnapshot: poll.StrategySnapshot}

// pollCompare runs the poll part on every broker: the WAL path and poll
// mode's two strategies.
func (b *bench) pollCompare(ctx context.Context) (*PollResult, error) {
	return b.compareSources(ctx, "poll", []string{"wal", sourcePollLease, sourcePollSnapshot}, pollMethod)
}

// messagesCompare runs the messages part on every broker: the table
// source and the messages source.
func (b *bench) messagesCompare(ctx context.Context) (*PollResult, error) {
	return b.compareSources(ctx, "messages", []string{"wal", "messages"}, messagesMethod)
}

// compareSources measures sources side by side, in this order and
// reversed on even repetitions, as the bench part part.
func (b *bench) compareSources(ctx context.Context, part string, sources []string, method string) (*PollResult, error) {
	res := &PollResult{Method: method}
	pg, closePG, err := harness.StartPostgresMain(harness.PGOptions{Settings: map[string]string{
		"max_wal_size": "16GB", "checkpoint_timeout": "30min", "shared_buffers": "256MB",
		"fsync": map[bool]string{true: "on", false: "off"}[b.o.pgFsync],
	}})
	if err != nil {
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	defer closePG()
	logDir, cleanup, err := b.logDirectory()
	if err != nil {
		return nil, err
	}
	defer cleanup()
	rates, err := b.o.pollRateList()
	if err != nil {
		return nil, err
	}
	for _, br := range b.brokers {
		for rep := 1; rep <= b.o.repeat; rep++ {
			// Every source with every variant, in this order and reversed
			// on even repetitions.
			var order []pollContender
			for _, source := range sources {
				for vi, v := range b.o.variants {
					if source == sourcePollSnapshot && !b.hasFlag(v, "poll-strategy") {
						continue // a relay from before the strategy: its lease mode is measured
					}
					order = append(order, pollContender{source: source, variant: vi})
				}
			}
			if rep%2 == 0 {
				slices.Reverse(order)
			}
			for _, c := range order {
				if err := ctx.Err(); err != nil {
					return res, err
				}
				m := &pollMeasure{b: b, pg: pg, br: br, part: part, source: c.source, variantIndex: c.variant, variant: b.o.variants[c.variant], rep: rep, logDir: logDir}
				if err := m.run(ctx, rates, res); err != nil {
					return res, fmt.Errorf("%s%s on %s: %w", c.source, vsuffix(m.variant.name), br.name, err)
				}
			}
		}
	}
	return res, nil
}

// binOf is variant v's relay binary.
func (b *bench) binOf(v variant) string {
	if v.bin != "" {
		return v.bin
	}
	return b.relayBin
}

// hasFlag says whether variant v's relay takes `run --flag`.
func (b *bench) hasFlag(v variant, flag string) bool {
	out, _ := exec.Command(b.binOf(v), "run", "-h").CombinedOutput()
	return strings.Contains(string(out), "-"+flag+" ")
}

// pollTargets adds poll mode's targets. Each strategy catching up: at
// least half the WAL path's rate in the same repetition, and at most 40 µs
// (lease) or 10 µs (snapshot) of PostgreSQL CPU per event. The snapshot
// strategy's own (issue 43): at most 50 B of WAL per event beside the
// inserts, no row changed outside the outbox, and a p99 at the highest
// steady rate no worse than the lease strategy's in the same repetition.
func (r *Results) pollTargets() {
	if r.Poll == nil {
		return
	}
	find := func(source, variant, broker string, rep int, phase string) *PollRun {
		for i := range r.Poll.Runs {
			run := &r.Poll.Runs[i]
			if run.Source == source && run.Variant == variant && run.Broker == broker && run.Rep == rep && run.Phase == phase {
				return run
			}
		}
		return nil
	}
	var variants, steadyPhases []string
	for _, run := range r.Poll.Runs {
		if !slices.Contains(variants, run.Variant) {
			variants = append(variants, run.Variant)
		}
		if run.Phase != "catch-up" && !slices.Contains(steadyPhases, run.Phase) {
			steadyPhases = append(steadyPhases, run.Phase)
		}
	}
	// The highest steady rate, "2000/s" of "500/s" and "2000/s".
	topPhase := ""
	for _, ph := range steadyPhases {
		if topPhase == "" || phaseRate(ph) > phaseRate(topPhase) {
			topPhase = ph
		}
	}
	for _, br := range r.Brokers {
		for _, v := range variants {
			for _, c := range []struct {
				source, name string
				cpu          float64
			}{{sourcePollLease, "poll mode", 40}, {sourcePollSnapshot, "poll mode, snapshot strategy,", 10}} {
				var ratios, pgCPU, wal []float64
				var rates []string
				for rep := 1; rep <= r.Repeat; rep++ {
					walRun, pollRun := find("wal", v, br, rep, "catch-up"), find(c.source, v, br, rep, "catch-up")
					if pollRun != nil {
						pgCPU = append(pgCPU, pollRun.PostgresCPUUsPerEvent)
						wal = append(wal, pollRun.WALBytesPerEvent)
					}
					if walRun != nil && pollRun != nil && walRun.EventsPerSec > 0 {
						ratios = append(ratios, pollRun.EventsPerSec/walRun.EventsPerSec)
						rates = append(rates, fmt.Sprintf("%.0f / %.0f", pollRun.EventsPerSec, walRun.EventsPerSec))
					}
				}
				r.target(c.name+" catch-up ÷ the WAL path's, "+br+vsuffix(v), "≥ 0.5", "", ratios,
					func(v float64) bool { return v >= 0.5 }, "events/s poll / WAL: "+strings.Join(rates, ", "))
				limit := c.cpu
				r.target(fmt.Sprintf("PostgreSQL CPU per event, %s catching up, %s%s", c.name, br, vsuffix(v)), fmt.Sprintf("≤ %.0f µs", limit), "µs", pgCPU,
					func(v float64) bool { return v <= limit }, "every PostgreSQL process, autovacuum included")
				if c.source == sourcePollSnapshot {
					r.target("WAL per event beside the inserts, "+c.name+" catching up, "+br+vsuffix(v), "≤ 50 B", "B", wal,
						func(v float64) bool { return v <= 50 }, "all WAL written while it drained the backlog, over its events")
				}
			}
			var changed, p99s []float64
			var p99Pairs []string
			for _, sz := range r.Poll.Sizes {
				if sz.Source == sourcePollSnapshot && sz.Variant == v && sz.Broker == br && sz.Events > 0 {
					changed = append(changed, float64(sz.ChangedOutsideOutbox)/float64(sz.Events))
				}
			}
			r.target("rows changed outside the outbox per event, poll mode, snapshot strategy, "+br+vsuffix(v), "0 (a progress row per page)", "", changed,
				func(v float64) bool { return v < 0.01 }, "updates and deletes of every other table over the whole pass, over its events; each leaves a dead tuple")
			for rep := 1; rep <= r.Repeat && topPhase != ""; rep++ {
				lease, snap := find(sourcePollLease, v, br, rep, topPhase), find(sourcePollSnapshot, v, br, rep, topPhase)
				if lease != nil && snap != nil && lease.P99Ms > 0 {
					p99s = append(p99s, snap.P99Ms/lease.P99Ms)
					p99Pairs = append(p99Pairs, fmt.Sprintf("%.1f / %.1f ms", snap.P99Ms, lease.P99Ms))
				}
			}
			r.target("p99 at "+topPhase+", snapshot ÷ lease strategy, "+br+vsuffix(v), "≤ 1", "", p99s,
				func(v float64) bool { return v <= 1 }, "commit to consumer, snapshot / lease: "+strings.Join(p99Pairs, ", "))
		}
	}
}

// phaseRate is a steady phase's rate, 2000 for "2000/s".
func phaseRate(phase string) int {
	n, _ := strconv.Atoi(strings.TrimSuffix(phase, "/s"))
	return n
}

// pollContender is a source with a relay variant, by its index.
type pollContender struct {
	source  string
	variant int
}

// pollMeasure is one source's pass on one broker: the steady rates, the
// catch-up, the sizes and the idle period.
type pollMeasure struct {
	b            *bench
	pg           *harness.Postgres
	br           *broker
	part         string // the bench part, for names and log lines
	source       string
	variant      variant
	variantIndex int
	rep          int
	logDir       string

	dsn   string
	topic string
	relay *relayProcess
	admin string
	// postmaster is the server's main process, whose children are every
	// other PostgreSQL process.
	postmaster int
}

func (m *pollMeasure) run(ctx context.Context, rates []int, res *PollResult) error {
	name := fmt.Sprintf("bench_%s_%s_%d_%s_%d", m.part, m.source, m.variantIndex, m.br.name, m.rep)
	if err := m.createDB(ctx, name); err != nil {
		return err
	}
	defer dropDatabase(m.pg, name)
	m.topic = fmt.Sprintf("bench.%s.%s.%d.%s.%d.%d", m.part, m.source, m.variantIndex, m.br.name, m.rep, time.Now().Unix())
	if err := m.br.createTopic(m.topic, m.b.o.partitions); err != nil {
		return err
	}
	if err := m.start(); err != nil {
		return err
	}
	defer func() { m.relay.stop() }()
	cons, err := consumeArrivals(m.br, m.topic, event.ReservedHeaders[0])
	if err != nil {
		return err
	}
	defer cons.stop()
	pad := m.b.o.payload - len(payloadJSON(0, 0))
	seen := 0
	for _, rate := range rates {
		if err := ctx.Err(); err != nil {
			return err
		}
		run, err := m.steady(ctx, cons, &seen, rate, pad)
		if err != nil {
			return fmt.Errorf("%d/s: %w", rate, err)
		}
		m.b.logf("%s part: %s on %s, %s: %.0f events/s, p50 %.1f ms, p99 %.1f ms, relay %.1f µs/event, postgres %.1f µs/event, WAL %.0f B/event",
			m.part, run.Source+vsuffix(run.Variant), run.Broker, run.Phase, run.EventsPerSec, run.P50Ms, run.P99Ms, run.RelayCPUUsPerEvent, run.PostgresCPUUsPerEvent, run.WALBytesPerEvent)
		res.Runs = append(res.Runs, run)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	run, err := m.catchUp(ctx, cons, &seen, pad)
	if err != nil {
		return fmt.Errorf("catch-up: %w", err)
	}
	m.b.logf("%s part: %s on %s, catch-up of %d: %.0f events/s, relay %.1f µs/event, postgres %.1f µs/event, WAL %.0f B/event (+%.0f writing)",
		m.part, run.Source+vsuffix(run.Variant), run.Broker, run.Events, run.EventsPerSec, run.RelayCPUUsPerEvent, run.PostgresCPUUsPerEvent, run.WALBytesPerEvent, run.FillWALBytesPerEvent)
	res.Runs = append(res.Runs, run)
	size, err := m.sizes(ctx)
	if err != nil {
		return err
	}
	res.Sizes = append(res.Sizes, size)
	idle, err := m.idle(ctx)
	if err != nil {
		return err
	}
	m.b.logf("%s part: %s on %s idle for %.0f s: relay %.2f ms CPU/s, postgres %.2f ms CPU/s, %.0f WAL B/s, %.2f statements/s",
		m.part, idle.Source+vsuffix(idle.Variant), idle.Broker, idle.Seconds, idle.RelayCPUMsPerS, idle.PostgresCPUMsPS, idle.WALBytesPerS, idle.StatementsPerS)
	res.Idle = append(res.Idle, idle)
	return nil
}

// createDB makes a database with the outbox schema for the source (poll
// mode's state table and trigger only for it), and for the WAL path its
// slot; it notes the server's postmaster.
func (m *pollMeasure) createDB(ctx context.Context, name string) error {
	dsn, err := createDatabase(ctx, m.pg, name, pollStrategies[m.source])
	if err != nil {
		return err
	}
	m.dsn = dsn
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	var self int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&self); err != nil {
		return err
	}
	if m.postmaster, err = parentPID(self); err != nil {
		return err
	}
	if pollStrategies[m.source] == "" {
		if _, err := createSlots(ctx, dsn, []string{"bench_poll"}); err != nil {
			return err
		}
	}
	return nil
}

// start runs the relay on the source and waits until it reads.
func (m *pollMeasure) start() error {
	admin, err := freeAddr()
	if err != nil {
		return err
	}
	m.admin = admin
	extra := []string{"--admin-addr", admin}
	switch m.source {
	case sourcePollSnapshot:
		extra = append(extra, "--source", "poll", "--poll-strategy", poll.StrategySnapshot)
	case "wal":
	default: // the lease strategy is the default: a relay from before the flag takes this too
		extra = append(extra, "--source", m.source)
	}
	p, err := m.b.startRelay(m.dsn, "bench_poll", m.br, m.topic, m.variant, filepath.Join(m.logDir, fmt.Sprintf("%s-%d-%s-%d.log", m.source, m.variantIndex, m.br.name, m.rep)), extra...)
	if err != nil {
		return err
	}
	select {
	case <-p.streaming:
	case err := <-p.done:
		p.done <- err
		return fmt.Errorf("relay exited before reading (%v); log tail:\n%s", err, p.logTail())
	case <-time.After(time.Minute):
		p.stop()
		return fmt.Errorf("relay not reading within a minute; log tail:\n%s", p.logTail())
	}
	m.relay = p
	return nil
}

// pgSpan samples what a phase costs: the relay's and PostgreSQL's CPU,
// the WAL position, the machine's busy share.
type pgSpan struct {
	relay, postgres float64
	wal             int64
	busy            busyMeter
	t0              time.Time
}

func (m *pollMeasure) sample(ctx context.Context, conn *pgx.Conn) (pgSpan, error) {
	s := pgSpan{relay: cpuOf(m.relay.cmd.Process.Pid), postgres: postgresCPU(m.postmaster), busy: startBusy(), t0: time.Now()}
	err := conn.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").Scan(&s.wal)
	return s, err
}

// finish fills run's per-event costs from the span's start and now.
func (m *pollMeasure) finish(ctx context.Context, conn *pgx.Conn, s pgSpan, run *PollRun) error {
	end, err := m.sample(ctx, conn)
	if err != nil {
		return err
	}
	n := float64(max(run.Events, 1))
	run.Seconds = time.Since(s.t0).Seconds()
	run.EventsPerSec = float64(run.Events) / run.Seconds
	run.RelayCPUUsPerEvent = (end.relay - s.relay) * 1e6 / n
	run.PostgresCPUUsPerEvent = (end.postgres - s.postgres) * 1e6 / n
	run.WALBytesPerEvent = float64(end.wal-s.wal) / n
	run.MachineBusyPercent = s.busy.percent()
	return nil
}

func (m *pollMeasure) steady(ctx context.Context, cons *arrivals, seen *int, rate, pad int) (PollRun, error) {
	run := PollRun{Source: m.source, Variant: m.variant.name, Broker: m.br.name, Phase: fmt.Sprintf("%d/s", rate), Rep: m.rep}
	pool, err := openWriters(ctx, m.dsn, m.b.steadyWriters(rate))
	if err != nil {
		return run, err
	}
	defer pool.close()
	if m.source == "messages" {
		pool.statement = steadyEmitSQL
	}
	warm, err := pool.write(ctx, rate, m.b.o.steadyWarm, m.b.o.aggregates, pad)
	if err != nil {
		return run, err
	}
	*seen += warm.n
	if !cons.await(*seen, 2*time.Minute) {
		return run, fmt.Errorf("warm-up: the consumer read %d of %d events; relay log tail:\n%s", cons.count(), *seen, m.relay.logTail())
	}
	conn, err := pgx.Connect(ctx, m.dsn)
	if err != nil {
		return run, err
	}
	defer conn.Close(context.Background())
	sp, err := m.sample(ctx, conn)
	if err != nil {
		return run, err
	}
	w, err := pool.write(ctx, rate, m.b.o.steadyFor, m.b.o.aggregates, pad)
	if err != nil {
		return run, err
	}
	*seen += w.n
	if !cons.await(*seen, 2*time.Minute) {
		return run, fmt.Errorf("the consumer read %d of %d events; relay log tail:\n%s", cons.count(), *seen, m.relay.logTail())
	}
	run.Events, run.RateHeld = w.n, w.held(rate, m.b.o.steadyFor)
	if err := m.finish(ctx, conn, sp, &run); err != nil {
		return run, err
	}
	var lat []float64
	for _, a := range cons.arrivedSince(*seen - w.n) {
		if t, ok := w.commits[a.key]; ok {
			lat = append(lat, a.at.Sub(t).Seconds())
		}
	}
	sort.Float64s(lat)
	run.P50Ms, run.P99Ms = 1000*percentile(lat, 0.5), 1000*percentile(lat, 0.99)
	return run, nil
}

// catchUp stops the relay, writes a backlog, and measures its drain.
func (m *pollMeasure) catchUp(ctx context.Context, cons *arrivals, seen *int, pad int) (PollRun, error) {
	run := PollRun{Source: m.source, Variant: m.variant.name, Broker: m.br.name, Phase: "catch-up", Rep: m.rep, Events: m.b.o.pollRows}
	m.relay.stop()
	conn, err := pgx.Connect(ctx, m.dsn)
	if err != nil {
		return run, err
	}
	defer conn.Close(context.Background())
	var before int64
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").Scan(&before); err != nil {
		return run, err
	}
	proc := "bench_fill"
	if m.source == "messages" {
		proc = "bench_fill_messages"
	}
	if _, err := fillWith(ctx, m.dsn, proc, run.Events, 10, m.b.o.prefillConns, m.b.o.aggregates, max(pad, 0)); err != nil {
		return run, err
	}
	sp, err := m.sample(ctx, conn)
	if err != nil {
		return run, err
	}
	run.FillWALBytesPerEvent = float64(sp.wal-before) / float64(run.Events)
	if err := m.start(); err != nil {
		return run, err
	}
	sp.relay = 0 // a new process
	*seen += run.Events
	if !cons.await(*seen, drainTimeout(run.Events)) {
		return run, fmt.Errorf("the consumer read %d of %d events; relay log tail:\n%s", cons.count(), *seen, m.relay.logTail())
	}
	return run, m.finish(ctx, conn, sp, &run)
}

// sizes reads the tables' sizes once every event is published.
func (m *pollMeasure) sizes(ctx context.Context) (PollSize, error) {
	s := PollSize{Source: m.source, Variant: m.variant.name, Broker: m.br.name}
	conn, err := pgx.Connect(ctx, m.dsn)
	if err != nil {
		return s, err
	}
	defer conn.Close(context.Background())
	if m.source == sourcePollLease {
		deadline := time.Now().Add(time.Minute)
		for {
			var pending int64
			if err := conn.QueryRow(ctx, "SELECT count(*) FROM outbox_events_poll WHERE published_at IS NULL").Scan(&pending); err != nil {
				return s, err
			}
			if pending == 0 {
				break
			}
			if time.Now().After(deadline) {
				return s, fmt.Errorf("%d rows still unpublished a minute after the consumer read every event", pending)
			}
			time.Sleep(100 * time.Millisecond) // the last marks follow the acks
		}
		if err := conn.QueryRow(ctx, `SELECT pg_table_size('outbox_events_poll'), pg_indexes_size('outbox_events_poll'),
			pg_relation_size('outbox_events_poll_pending_idx')`).Scan(&s.StateBytes, &s.StateIndexBytes, &s.PendingIndexBytes); err != nil {
			return s, err
		}
	}
	if m.source == sourcePollSnapshot {
		if err := conn.QueryRow(ctx, `SELECT pg_table_size('outbox_events_poll_snapshot'), pg_indexes_size('outbox_events_poll_snapshot'),
			pg_relation_size('outbox_events_poll_snapshot_xid_idx')`).Scan(&s.StateBytes, &s.StateIndexBytes, &s.PendingIndexBytes); err != nil {
			return s, err
		}
	}
	err = conn.QueryRow(ctx, `SELECT count(*), pg_table_size('outbox_events'), pg_indexes_size('outbox_events') FROM outbox_events`).
		Scan(&s.Events, &s.OutboxBytes, &s.OutboxIndexBytes)
	if err != nil {
		return s, err
	}
	// Dead tuples outside the outbox: what the source writes beside the
	// events themselves (the outbox's own come from retention, off here).
	err = conn.QueryRow(ctx, `SELECT COALESCE(sum(n_dead_tup), 0)::bigint, COALESCE(sum(n_tup_upd + n_tup_del) FILTER (WHERE relname <> 'outbox_events'), 0)::bigint
		FROM pg_stat_user_tables`).Scan(&s.DeadTuples, &s.ChangedOutsideOutbox)
	return s, err
}

// idle measures the running relay while nothing is written, after a
// VACUUM ANALYZE of the database.
func (m *pollMeasure) idle(ctx context.Context) (PollIdle, error) {
	idle := PollIdle{Source: m.source, Variant: m.variant.name, Broker: m.br.name}
	conn, err := pgx.Connect(ctx, m.dsn)
	if err != nil {
		return idle, err
	}
	defer conn.Close(context.Background())
	statements := func() (float64, error) {
		var n float64
		err := conn.QueryRow(ctx, `SELECT COALESCE(sum(xact_commit + xact_rollback), 0)::float8 FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
		return n, err
	}
	// The dead tuples of the phases before are vacuumed first, so the
	// idle period shows what idling costs, not autovacuum catching up.
	if _, err := conn.Exec(ctx, "VACUUM ANALYZE"); err != nil {
		return idle, fmt.Errorf("vacuum before the idle period: %w", err)
	}
	s0, err := statements()
	if err != nil {
		return idle, err
	}
	sp, err := m.sample(ctx, conn)
	if err != nil {
		return idle, err
	}
	select { // the idle period itself: nothing to wait for
	case <-time.After(m.b.o.pollIdle):
	case <-ctx.Done():
		return idle, ctx.Err()
	}
	end, err := m.sample(ctx, conn)
	if err != nil {
		return idle, err
	}
	s1, err := statements()
	if err != nil {
		return idle, err
	}
	secs := time.Since(sp.t0).Seconds()
	idle.Seconds = secs
	idle.RelayCPUMsPerS = (end.relay - sp.relay) * 1000 / secs
	idle.PostgresCPUMsPS = (end.postgres - sp.postgres) * 1000 / secs
	idle.WALBytesPerS = float64(end.wal-sp.wal) / secs
	// The two statements of the sampling itself are not the relay's.
	idle.StatementsPerS = max(s1-s0-4, 0) / secs
	return idle, nil
}

// postgresCPU is the CPU of the postmaster, its live children and the
// children it reaped: every PostgreSQL process, exited ones included.
func postgresCPU(postmaster int) float64 {
	total := 0.0
	if fields, err := statFields(postmaster); err == nil && len(fields) > 16 {
		for _, f := range fields[13:17] { // utime, stime, cutime, cstime
			v, _ := strconv.ParseFloat(f, 64)
			total += v / clockTicks
		}
	}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, err := parentPID(pid); err == nil && ppid == postmaster {
			total += cpuOf(pid)
		}
	}
	return total
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat's times on Linux.
const clockTicks = 100

// statFields are /proc/<pid>/stat's fields, field n (numbered from 1 as
// in proc(5)) at index n-1; the command name is left empty.
func statFields(pid int) ([]string, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	s := string(raw)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil, fmt.Errorf("/proc/%d/stat: no command", pid)
	}
	rest := strings.Fields(s[i+1:]) // from field 3, the state
	return append([]string{"", ""}, rest...), nil
}

func parentPID(pid int) (int, error) {
	fields, err := statFields(pid)
	if err != nil || len(fields) < 4 {
		return 0, fmt.Errorf("parent of %d: %v", pid, err)
	}
	return strconv.Atoi(fields[3])
}

func (r *Results) pollMarkdown(w func(string, ...any)) {
	sourcesMarkdown(w, r.Poll, "Polling or CDC: poll mode and the WAL path side by side")
	sourcesMarkdown(w, r.Messages, "Messages: the messages source and the table source side by side")
}

// sourcesMarkdown writes a part that measured sources side by side.
func sourcesMarkdown(w func(string, ...any), res *PollResult, title string) {
	if res == nil || len(res.Runs) == 0 {
		return
	}
	w("\n## %s\n\n%s.\n\n", title, res.Method)
	w("| broker | phase | source | rep | events | events/s | p50 ms | p99 ms | relay µs/event | PostgreSQL µs/event | WAL B/event | machine busy |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	runs := append([]PollRun(nil), res.Runs...)
	sort.SliceStable(runs, func(i, j int) bool {
		a, b := runs[i], runs[j]
		if a.Broker != b.Broker {
			return a.Broker < b.Broker
		}
		if a.Phase != b.Phase {
			return phaseOrder(a.Phase) < phaseOrder(b.Phase)
		}
		if a.Rep != b.Rep {
			return a.Rep < b.Rep
		}
		if a.Source != b.Source {
			return a.Source == "wal" // wal first
		}
		return a.Variant < b.Variant
	})
	for _, x := range runs {
		wal := fmt.Sprintf("%.0f", x.WALBytesPerEvent)
		if x.FillWALBytesPerEvent > 0 {
			wal = fmt.Sprintf("%.0f (+%.0f writing)", x.WALBytesPerEvent, x.FillWALBytesPerEvent)
		}
		latency := func(v float64) string {
			if x.Phase == "catch-up" {
				return "–"
			}
			return fmt.Sprintf("%.1f", v)
		}
		held := ""
		if x.Phase != "catch-up" && !x.RateHeld {
			held = " (rate not held)"
		}
		w("| %s | %s%s | %s | %d | %d | %.0f | %s | %s | %.1f | %.1f | %s | %.0f%% |\n", x.Broker, x.Phase, held, x.Source+vsuffix(x.Variant), x.Rep, x.Events, x.EventsPerSec,
			latency(x.P50Ms), latency(x.P99Ms), x.RelayCPUUsPerEvent, x.PostgresCPUUsPerEvent, wal, x.MachineBusyPercent)
	}
	w("\nTables once every event is published (outbox, and poll mode's state table beside it; dead tuples in all tables, autovacuum on):\n\n")
	w("| broker | source | events | outbox MB | outbox indexes MB | state MB | state indexes MB | pending-rows index kB | dead tuples |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, x := range res.Sizes {
		w("| %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %.0f | %d |\n", x.Broker, x.Source+vsuffix(x.Variant), x.Events, mb(x.OutboxBytes), mb(x.OutboxIndexBytes),
			mb(x.StateBytes), mb(x.StateIndexBytes), float64(x.PendingIndexBytes)/1024, x.DeadTuples)
	}
	w("\nIdle, the relay running and nothing written, after a VACUUM ANALYZE:\n\n| broker | source | seconds | relay CPU ms/s | PostgreSQL CPU ms/s | WAL B/s | transactions/s |\n|---|---|---|---|---|---|---|\n")
	for _, x := range res.Idle {
		w("| %s | %s | %.0f | %.2f | %.2f | %.0f | %.2f |\n", x.Broker, x.Source+vsuffix(x.Variant), x.Seconds, x.RelayCPUMsPerS, x.PostgresCPUMsPS, x.WALBytesPerS, x.StatementsPerS)
	}
}

func mb(b int64) float64 { return float64(b) / (1 << 20) }

// phaseOrder puts the steady rates first, by rate, then catch-up.
func phaseOrder(phase string) int {
	if n, err := strconv.Atoi(strings.TrimSuffix(phase, "/s")); err == nil {
		return n
	}
	return 1 << 30
}
