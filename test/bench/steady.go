package main

import (
	"context"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// SteadyRun is one reader at one steady commit rate: the relay (a
// subprocess, per variant), pg_recvlogical alone, or a bare producer floor.
type SteadyRun struct {
	Rate    int    `json:"rate"`
	Reader  string `json:"reader"` // relay/<broker>, pg_recvlogical, floor-sarama/<broker>, floor-franz-go/<broker>
	Variant string `json:"variant,omitempty"`
	// Mode is the delivery mode, in the exactly-once part only.
	Mode   string `json:"mode,omitempty"`
	Rep    int    `json:"rep"`
	Linger string `json:"linger,omitempty"` // floor only
	// Writers is the number of writer connections; RateHeld says whether
	// they kept the open-loop schedule (achieved ≥ 97% of the rate and
	// p99 lateness ≤ 50 ms).
	Writers         int     `json:"writers,omitempty"`
	RateHeld        bool    `json:"rate_held"`
	WriterLateP99Ms float64 `json:"writer_late_p99_ms,omitempty"`
	// Events counts the measured events; Seconds runs from the first
	// measured commit (or send) until the consumer held the last one.
	Events       int     `json:"events"`
	Seconds      float64 `json:"seconds"`
	AchievedRate float64 `json:"achieved_rate"`
	// CPUUsPerEvent is the reader's own CPU time over Seconds.
	CPUUsPerEvent float64 `json:"cpu_us_per_event"`
	PeakRSSMB     float64 `json:"peak_rss_mb,omitempty"`
	// BrokerCPUUsPerEvent: the JVM for Apache Kafka, kfake's own process
	// for kfake; the independent consumer's fetches are included.
	BrokerCPUUsPerEvent float64 `json:"broker_cpu_us_per_event,omitempty"`
	// PostgresCPUUsPerEvent is the walsender plus the writers' backends.
	PostgresCPUUsPerEvent float64 `json:"postgres_cpu_us_per_event,omitempty"`
	// HarnessCPUUsPerEvent is the benchmark's own process: the writers'
	// client side and the independent consumer. It shares the machine
	// with what is measured.
	HarnessCPUUsPerEvent   float64 `json:"harness_cpu_us_per_event,omitempty"`
	WalsenderCPUUsPerEvent float64 `json:"walsender_cpu_us_per_event,omitempty"`
	// P*Ms: commit (the writer's Exec returning) to the independent
	// consumer reading the record; for the floors, building the record to
	// the consumer reading it.
	P50Ms  float64 `json:"p50_ms,omitempty"`
	P99Ms  float64 `json:"p99_ms,omitempty"`
	P999Ms float64 `json:"p999_ms,omitempty"`
	MaxMs  float64 `json:"max_ms,omitempty"`
	// Receive*: the relay's outbox_relay_commit_to_receive_seconds over the
	// measured span (bucket-interpolated p99); ReceiveShare is its mean
	// over the mean commit-to-consumer latency.
	ReceiveMeanMs float64 `json:"receive_mean_ms,omitempty"`
	ReceiveP99Ms  float64 `json:"receive_p99_ms,omitempty"`
	ReceiveShare  float64 `json:"receive_share,omitempty"`
	// AckP99Ms is the relay's own outbox_relay_commit_to_ack_seconds p99.
	AckP99Ms           float64 `json:"ack_p99_ms,omitempty"`
	MachineBusyPercent float64 `json:"machine_busy_percent"`
	// StealPercent is the part of MachineBusyPercent the host took from
	// this virtual machine's CPUs.
	StealPercent float64 `json:"steal_percent"`
}

func (r *SteadyRun) label() string { return readerLabel(r.Reader, r.Variant) }

// SteadyResult is the steady-rate part.
type SteadyResult struct {
	Method string      `json:"method"`
	Runs   []SteadyRun `json:"runs"`
}

const steadyMethod = "single-row transactions committed (synchronous_commit=on) on an open-loop schedule by enough connections to hold the rate; " +
	"after a warm-up at the same rate, the measured span runs from the first measured commit until an independent franz-go consumer read the last record. " +
	"Each relay is a subprocess with default flags on a fresh slot and topic; CPU is the process's CPU clock (all threads, in nanoseconds) over the span"

// steadyInsertSQL takes the event_id from the writer, so the consumer's
// event_id header finds the commit time.
const steadyInsertSQL = `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
VALUES ($1::uuid, 'order', $2, 'order.updated', $3::jsonb)`

// steadyEmitSQL is steadyInsertSQL for the messages source, with the
// same parameters, its content built as the writer library's Emit does.
const steadyEmitSQL = `SELECT pg_logical_emit_message(true, 'outbox', jsonb_build_object(
	'event_id', $1::uuid, 'aggregate_type', 'order', 'aggregate_id', $2::text, 'event_type', 'order.updated',
	'schema_version', 1, 'payload', $3::jsonb, 'occurred_at', now())::text)`

// liveRelayDB creates database name for live runs of relay subprocesses,
// and the directory their logs go to; done drops and removes both.
func (b *bench) liveRelayDB(ctx context.Context, name string) (dsn, logDir string, done func(), err error) {
	dsn, err = b.createDB(ctx, name)
	if err != nil {
		return "", "", nil, err
	}
	logDir, cleanup, err := b.logDirectory()
	if err != nil {
		b.dropDB(name)
		return "", "", nil, err
	}
	return dsn, logDir, func() { cleanup(); b.dropDB(name) }, nil
}

// steady runs every rate: pg_recvlogical alone, the bare producer floors on
// each broker, then the relay variants on each broker, side by side.
func (b *bench) steady(ctx context.Context) (*SteadyResult, error) {
	res := &SteadyResult{Method: steadyMethod}
	dsn, logDir, done, err := b.liveRelayDB(ctx, "bench_steady")
	if err != nil {
		return nil, err
	}
	defer done()
	rates, _ := b.o.steadyRateList()
	pad := b.o.payload - len(payloadJSON(0, 0))
	for rep := 1; rep <= b.o.repeat; rep++ {
		for _, rate := range rates {
			add := func(r SteadyRun, err error) error {
				if err != nil {
					return fmt.Errorf("%d/s, %s: %w", rate, r.label(), err)
				}
				r.Rep = rep
				b.logSteady(r)
				res.Runs = append(res.Runs, r)
				return nil
			}
			if err := add(b.steadyRecvLogical(ctx, dsn, rate, pad, rep)); err != nil {
				return res, err
			}
			for _, br := range b.brokers {
				if !b.o.skip["floor"] {
					for _, linger := range b.floorLingers() {
						for _, client := range []string{"sarama", "franz-go"} {
							if err := add(b.steadyFloor(ctx, br, client, rate, linger, pad)); err != nil {
								return res, err
							}
						}
					}
				}
				for vi, v := range b.o.variants {
					if err := ctx.Err(); err != nil {
						return res, err
					}
					if err := add(b.steadyRelay(ctx, dsn, br, vi, v, rate, pad, rep, logDir)); err != nil {
						return res, err
					}
				}
			}
		}
	}
	return res, nil
}

func (b *bench) logSteady(r SteadyRun) {
	held := ""
	if !r.RateHeld {
		held = fmt.Sprintf(" — RATE NOT HELD (writers p99 late %.0f ms)", r.WriterLateP99Ms)
	}
	b.logf("steady %d/s #%d %s: %.0f/s achieved, %d events; CPU %.1f µs/event, broker %.1f µs/event, PostgreSQL %.1f µs/event, harness %.1f µs/event; p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms; receive share %.0f%%; machine %.0f%% busy (steal %.0f%%)%s",
		r.Rate, r.Rep, r.label(), r.AchievedRate, r.Events, r.CPUUsPerEvent, r.BrokerCPUUsPerEvent, r.PostgresCPUUsPerEvent, r.HarnessCPUUsPerEvent,
		r.P50Ms, r.P99Ms, r.P999Ms, 100*r.ReceiveShare, r.MachineBusyPercent, r.StealPercent, held)
}

// steadyWriters picks how many connections hold rate: each commit with
// synchronous_commit=on takes a fraction of a millisecond on an idle
// machine and several on a busy one, so each connection is given 2 ms.
func (b *bench) steadyWriters(rate int) int {
	if b.o.steadyWriters > 0 {
		return b.o.steadyWriters
	}
	return max(2, int(math.Ceil(float64(rate)*0.002)))
}

// writerPool is a set of writer connections and their backends' PIDs.
type writerPool struct {
	dsn   string
	conns []*pgx.Conn
	pids  []int
	// statement writes one event: steadyInsertSQL unless set.
	statement string
}

func openWriters(ctx context.Context, dsn string, n int) (*writerPool, error) {
	w := &writerPool{dsn: dsn}
	for range n {
		c, err := pgx.Connect(ctx, dsn)
		if err != nil {
			w.close()
			return nil, err
		}
		w.conns = append(w.conns, c)
		var pid int
		if err := c.QueryRow(ctx, "SET synchronous_commit = on; SELECT pg_backend_pid()").Scan(&pid); err != nil {
			// Two statements in one simple query: pgx returns the last
			// result, but fall back to two round trips if it does not.
			if _, err := c.Exec(ctx, "SET synchronous_commit = on"); err != nil {
				w.close()
				return nil, err
			}
			if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				w.close()
				return nil, err
			}
		}
		w.pids = append(w.pids, pid)
	}
	return w, nil
}

func (w *writerPool) close() {
	for _, c := range w.conns {
		c.Close(context.Background())
	}
}

// written is what one paced write produced.
type written struct {
	commits   map[string]time.Time // event_id → when its commit returned
	n         int
	elapsed   time.Duration
	lateP99Ms float64 // how far behind schedule transactions started
}

// write commits single-row transactions on an open-loop schedule: k is due
// at start + k/rate, spread over the connections; a connection that falls
// behind catches up without sleeping, and its lateness is recorded.
func (w *writerPool) write(ctx context.Context, rate int, d time.Duration, aggregates, pad int) (written, error) {
	n := len(w.conns)
	commits := make([]map[string]time.Time, n)
	lates := make([][]float64, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range w.conns {
		commits[i] = map[string]time.Time{}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c := w.conns[i]
			for k := i; ; k += n {
				due := start.Add(time.Duration(float64(k) * float64(time.Second) / float64(rate)))
				if time.Since(start) >= d || !due.Before(start.Add(d)) {
					return
				}
				if wait := time.Until(due); wait > 0 {
					time.Sleep(wait) // pacing the open-loop schedule
				}
				lates[i] = append(lates[i], time.Since(due).Seconds())
				id := harness.NewUUID()
				statement := w.statement
				if statement == "" {
					statement = steadyInsertSQL
				}
				if _, err := c.Exec(ctx, statement, id, "agg-"+strconv.Itoa(k%aggregates), payloadJSON(k, pad)); err != nil {
					errs[i] = err
					return
				}
				commits[i][id] = time.Now()
			}
		}(i)
	}
	wg.Wait()
	out := written{commits: map[string]time.Time{}, elapsed: time.Since(start)}
	var late []float64
	for i := range commits {
		if errs[i] != nil {
			return out, fmt.Errorf("writer: %w", errs[i])
		}
		for id, t := range commits[i] {
			out.commits[id] = t
		}
		late = append(late, lates[i]...)
	}
	out.n = len(out.commits)
	sort.Float64s(late)
	out.lateP99Ms = 1000 * percentile(late, 0.99)
	return out, nil
}

// held says whether the writers kept the schedule.
func (w written) held(rate int, d time.Duration) bool {
	return float64(w.n) >= 0.97*float64(rate)*d.Seconds() && w.lateP99Ms <= 50
}

// cpuOf sums the CPU time of processes that may have exited (they count 0).
func cpuOf(pids ...int) float64 {
	total := 0.0
	for _, pid := range pids {
		if s, err := cpuSeconds(pid); err == nil {
			total += s
		}
	}
	return total
}

// walsenderPID waits for the slot's walsender.
func walsenderPID(ctx context.Context, conn *pgx.Conn, slot string) (int, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		st, err := readSlot(ctx, conn, slot)
		if err != nil {
			return 0, err
		}
		if st.activePID != 0 {
			return st.activePID, nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("slot %s: no walsender within a minute", slot)
		}
		time.Sleep(20 * time.Millisecond) // polling the slot
	}
}

// span is the CPU of the processes in one measurement, sampled at its
// start and end.
type span struct {
	reader, broker, walsender, backends, harness float64
	busy                                         busyMeter
	t0                                           time.Time
}

type spanPIDs struct {
	reader, walsender int
	backends          []int
	br                *broker
}

func (p spanPIDs) sample() span {
	s := span{reader: cpuOf(p.reader), walsender: cpuOf(p.walsender), backends: cpuOf(p.backends...), harness: cpuOf(os.Getpid())}
	if p.br != nil {
		s.broker = p.br.cpuSeconds()
	}
	return s
}

func startSpan(p spanPIDs) span {
	s := p.sample()
	s.busy, s.t0 = startBusy(), time.Now()
	return s
}

// finish fills run's CPU columns from the span's start and the samples now.
func (s span) finish(p spanPIDs, run *SteadyRun) {
	end := p.sample()
	run.Seconds = time.Since(s.t0).Seconds()
	run.MachineBusyPercent, run.StealPercent = s.busy.percents()
	per := func(v float64) float64 { return v * 1e6 / float64(max(run.Events, 1)) }
	run.CPUUsPerEvent = per(end.reader - s.reader)
	run.HarnessCPUUsPerEvent = per(end.harness - s.harness)
	if p.br != nil {
		run.BrokerCPUUsPerEvent = per(end.broker - s.broker)
	}
	if p.walsender != 0 {
		run.WalsenderCPUUsPerEvent = per(end.walsender - s.walsender)
		run.PostgresCPUUsPerEvent = per(end.walsender - s.walsender + end.backends - s.backends)
	}
}

// latencies fills the percentile columns from latencies in seconds.
func (run *SteadyRun) latencies(v []float64) {
	sort.Float64s(v)
	run.P50Ms, run.P99Ms = 1000*percentile(v, 0.5), 1000*percentile(v, 0.99)
	run.P999Ms, run.MaxMs = 1000*percentile(v, 0.999), 1000*percentile(v, 1)
}

func mean(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := 0.0
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

// steadyRelay measures one relay variant at rate against br.
func (b *bench) steadyRelay(ctx context.Context, dsn string, br *broker, vi int, v variant, rate, pad, rep int, logDir string) (SteadyRun, error) {
	return b.steadyRelayWith(ctx, dsn, br, vi, v, rate, pad, rep, logDir, "")
}

// steadyRelayWith is steadyRelay with the writers' statement (see
// writerPool.statement).
func (b *bench) steadyRelayWith(ctx context.Context, dsn string, br *broker, vi int, v variant, rate, pad, rep int, logDir, statement string) (SteadyRun, error) {
	run := SteadyRun{Rate: rate, Reader: "relay/" + br.name, Variant: v.name}
	slot := relaySlot(fmt.Sprintf("steady%d", rate), br, vi, rep)
	if _, err := createSlots(ctx, dsn, []string{slot}); err != nil {
		return run, err
	}
	defer b.dropSlot(ctx, dsn, slot)
	topic := fmt.Sprintf("bench.steady.%s.%d.%d.%d.%d", br.name, rate, vi, rep, time.Now().Unix())
	if err := br.createTopic(topic, b.o.partitions); err != nil {
		return run, err
	}
	admin, err := freeAddr()
	if err != nil {
		return run, err
	}
	p, err := b.startRelay(dsn, slot, br, topic, v, filepath.Join(logDir, slot+".log"), "--admin-addr", admin)
	if err != nil {
		return run, err
	}
	defer p.stop()
	select {
	case <-p.streaming:
	case err := <-p.done:
		p.done <- err
		return run, fmt.Errorf("relay exited before streaming (%v); log tail:\n%s", err, p.logTail())
	case <-time.After(time.Minute):
		return run, fmt.Errorf("relay not streaming within a minute; log tail:\n%s", p.logTail())
	case <-ctx.Done():
		return run, ctx.Err()
	}
	cons, err := consumeArrivals(br, topic, event.ReservedHeaders[0])
	if err != nil {
		return run, err
	}
	defer cons.stop()
	db, err := b.openSteadyDB(ctx, dsn, slot, &run)
	if err != nil {
		return run, err
	}
	defer db.close()
	pool := db.pool
	pool.statement = statement

	warm, err := pool.write(ctx, rate, b.o.steadyWarm, b.o.aggregates, pad)
	if err != nil {
		return run, err
	}
	if !cons.await(warm.n, 2*time.Minute) {
		return run, fmt.Errorf("warm-up: the consumer read %d of %d events within 2 minutes; relay log tail:\n%s", cons.count(), warm.n, p.logTail())
	}
	metricsURL := "http://" + admin + "/metrics"
	const recvName, ackName = "outbox_relay_commit_to_receive_seconds", "outbox_relay_commit_to_ack_seconds"
	before, err := scrapeHistograms(ctx, metricsURL, recvName, ackName)
	if err != nil {
		return run, err
	}
	pids := spanPIDs{reader: p.cmd.Process.Pid, walsender: db.walsender, backends: pool.pids, br: br}
	sp := startSpan(pids)
	w, err := b.measuredWrite(ctx, pool, rate, pad, &run)
	if err != nil {
		return run, err
	}
	if !cons.await(warm.n+w.n, 2*time.Minute) {
		return run, fmt.Errorf("the consumer read %d of %d events within 2 minutes; relay log tail:\n%s", cons.count(), warm.n+w.n, p.logTail())
	}
	sp.finish(pids, &run)
	if hwm, err := memKB(p.cmd.Process.Pid, "VmHWM"); err == nil {
		run.PeakRSSMB = float64(hwm) / 1024
	}
	after, err := scrapeHistograms(ctx, metricsURL, recvName, ackName)
	if err != nil {
		return run, err
	}
	var lat []float64
	for _, a := range cons.stop() {
		if t, ok := w.commits[a.key]; ok {
			lat = append(lat, a.at.Sub(t).Seconds())
		}
	}
	if len(lat) < w.n {
		return run, fmt.Errorf("the consumer read %d of the %d measured events", len(lat), w.n)
	}
	m := mean(lat)
	run.latencies(lat)
	recv, ack := after[recvName].minus(before[recvName]), after[ackName].minus(before[ackName])
	run.ReceiveMeanMs, run.ReceiveP99Ms, run.AckP99Ms = 1000*recv.mean(), 1000*recv.quantile(0.99), 1000*ack.quantile(0.99)
	if m > 0 {
		run.ReceiveShare = recv.mean() / m
	}
	return run, nil
}

// steadyRecvLogical measures pg_recvlogical reading the same stream at rate:
// the floor of reading and confirming, with nothing sent anywhere.
func (b *bench) steadyRecvLogical(ctx context.Context, dsn string, rate, pad, rep int) (SteadyRun, error) {
	run := SteadyRun{Rate: rate, Reader: "pg_recvlogical"}
	slot := fmt.Sprintf("steady%d_recvlogical_%d", rate, rep)
	if _, err := createSlots(ctx, dsn, []string{slot}); err != nil {
		return run, err
	}
	defer b.dropSlot(ctx, dsn, slot)
	cmd := exec.Command(recvlogicalPath(), "-d", libpqDSN(dsn), "-S", slot, "--start", "--no-loop",
		"-o", "proto_version=1", "-o", "publication_names="+publication, "-f", "/dev/null")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return run, fmt.Errorf("start pg_recvlogical: %w", err)
	}
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		_ = cmd.Wait()
	}()
	db, err := b.openSteadyDB(ctx, dsn, slot, &run)
	if err != nil {
		return run, err
	}
	defer db.close()
	conn, ws := db.conn, db.walsender
	if _, err := db.pool.write(ctx, rate, b.o.steadyWarm, b.o.aggregates, pad); err != nil {
		return run, err
	}
	pids := spanPIDs{reader: cmd.Process.Pid, walsender: ws, backends: db.pool.pids}
	sp := startSpan(pids)
	if _, err := b.measuredWrite(ctx, db.pool, rate, pad, &run); err != nil {
		return run, err
	}
	// Everything written has been sent once the walsender's sent_lsn
	// passes the WAL position after the last commit.
	var endText string
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&endText); err != nil {
		return run, err
	}
	end, err := lsn.Parse(endText)
	if err != nil {
		return run, err
	}
	if err := waitSent(ctx, conn, ws, end); err != nil {
		return run, err
	}
	sp.finish(pids, &run)
	return run, nil
}

// steadyDB is the database side of one measurement: a connection to watch
// the slot, the slot's walsender and the writers.
type steadyDB struct {
	conn      *pgx.Conn
	walsender int
	pool      *writerPool
}

// openSteadyDB waits for the slot's walsender and opens the writers run
// needs for its rate.
func (b *bench) openSteadyDB(ctx context.Context, dsn, slot string, run *SteadyRun) (*steadyDB, error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	ws, err := walsenderPID(ctx, conn, slot)
	if err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	run.Writers = b.steadyWriters(run.Rate)
	pool, err := openWriters(ctx, dsn, run.Writers)
	if err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	return &steadyDB{conn: conn, walsender: ws, pool: pool}, nil
}

func (d *steadyDB) close() {
	d.pool.close()
	d.conn.Close(context.Background())
}

// measuredWrite writes at rate for the measured span and fills run's writer
// columns.
func (b *bench) measuredWrite(ctx context.Context, pool *writerPool, rate, pad int, run *SteadyRun) (written, error) {
	w, err := pool.write(ctx, rate, b.o.steadyFor, b.o.aggregates, pad)
	if err != nil {
		return w, err
	}
	run.Events, run.WriterLateP99Ms, run.RateHeld = w.n, w.lateP99Ms, w.held(rate, b.o.steadyFor)
	run.AchievedRate = float64(w.n) / w.elapsed.Seconds()
	return w, nil
}

// waitSent polls until the walsender pid has sent WAL up to end.
func waitSent(ctx context.Context, conn *pgx.Conn, pid int, end lsn.LSN) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var sent *string
		if err := conn.QueryRow(ctx, "SELECT sent_lsn::text FROM pg_stat_replication WHERE pid = $1", pid).Scan(&sent); err != nil {
			return fmt.Errorf("read sent_lsn: %w", err)
		}
		if sent != nil {
			if at, err := lsn.Parse(*sent); err == nil && at >= end {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("walsender %d did not send up to %s within 2 minutes", pid, end)
		}
		time.Sleep(5 * time.Millisecond) // polling the walsender
	}
}

// floorLingers are the lingers of the steady-rate floors: those asked for,
// else --linger, else the relay's default.
func (b *bench) floorLingers() []time.Duration {
	switch {
	case len(b.o.floorLingers) > 0:
		return b.o.floorLingers
	case b.o.linger >= 0:
		return []time.Duration{b.o.linger}
	}
	return []time.Duration{publisher.DefaultConfig().Linger}
}

// steadyFloor runs a bare producer (sarama with the relay's settings, or
// franz-go) in its own process at rate and linger.
func (b *bench) steadyFloor(ctx context.Context, br *broker, client string, rate int, linger time.Duration, pad int) (SteadyRun, error) {
	run := SteadyRun{Rate: rate, Reader: "floor-" + client + "/" + br.name, Linger: linger.String(), RateHeld: true}
	topic := fmt.Sprintf("bench.steadyfloor.%s.%s.%d.%d", br.name, client, rate, time.Now().UnixNano())
	if err := br.createTopic(topic, b.o.partitions); err != nil {
		return run, err
	}
	cons, err := consumeArrivals(br, topic, sentHeader)
	if err != nil {
		return run, err
	}
	defer cons.stop()
	compression := orDefault(b.o.compression, publisher.DefaultConfig().Compression)
	fp, err := startFloorProcess(floorArgs{client: client, brokers: br.list(), topic: topic, rate: rate,
		duration: b.o.steadyFor, warm: b.o.steadyWarm, linger: linger, compression: compression,
		payload: b.o.payload, aggregates: b.o.aggregates})
	if err != nil {
		return run, err
	}
	pids := spanPIDs{br: br}
	var sp span
	var from int64
	select {
	case ns := <-fp.measuring:
		sp, from = startSpan(pids), ns
	case err := <-fp.done:
		fp.done <- err
	case <-time.After(2 * time.Minute):
	}
	rep, err := fp.wait(ctx, b.o.steadyFor+2*time.Minute)
	if err != nil {
		return run, err
	}
	if from == 0 {
		return run, fmt.Errorf("floor producer never started measuring")
	}
	run.Events = rep.Records
	run.AchievedRate = float64(rep.Records) / b.o.steadyFor.Seconds()
	if !cons.await(rep.Total, 2*time.Minute) {
		return run, fmt.Errorf("the consumer read %d of %d records within 2 minutes", cons.count(), rep.Total)
	}
	sp.finish(pids, &run)
	run.CPUUsPerEvent = rep.CPUSeconds * 1e6 / float64(max(rep.Records, 1))
	var lat []float64
	for _, a := range cons.stop() {
		ns, err := strconv.ParseInt(a.key, 10, 64)
		if err == nil && ns >= from {
			lat = append(lat, a.at.Sub(time.Unix(0, ns)).Seconds())
		}
	}
	run.latencies(lat)
	return run, nil
}

// freeAddr returns a 127.0.0.1 address with a port free right now.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// steadySummary is the one-line history cell: per broker and variant at
// 2,000/s, relay CPU ÷ pg_recvlogical's and p99 ms.
func (r *Results) steadySummary() string {
	if r.Steady == nil {
		return "–"
	}
	var parts []string
	for _, run := range r.Steady.Runs {
		if run.Rate != 2000 || !strings.HasPrefix(run.Reader, "relay/") {
			continue
		}
		recv := r.Steady.run(2000, "pg_recvlogical", "", run.Rep)
		ratio := 0.0
		if recv != nil && recv.CPUUsPerEvent > 0 {
			ratio = run.CPUUsPerEvent / recv.CPUUsPerEvent
		}
		parts = append(parts, fmt.Sprintf("%s %.0f µs %.1f× %.1f ms", run.label(), run.CPUUsPerEvent, ratio, run.P99Ms))
	}
	if len(parts) == 0 {
		return "–"
	}
	return strings.Join(parts, "; ")
}

func (s *SteadyResult) run(rate int, reader, variant string, rep int) *SteadyRun {
	for i := range s.Runs {
		r := &s.Runs[i]
		if r.Rate == rate && r.Reader == reader && r.Variant == variant && r.Rep == rep {
			return r
		}
	}
	return nil
}
