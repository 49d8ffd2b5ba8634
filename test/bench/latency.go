package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// LatencyPhase is commit-to-ack latency at one commit rate.
type LatencyPhase struct {
	Rep          int     `json:"rep"`
	TargetRate   int     `json:"target_rate"` // 0: as fast as the writers go
	AchievedRate float64 `json:"achieved_rate"`
	Seconds      float64 `json:"seconds"`
	Written      int64   `json:"written"`
	Measured     int     `json:"measured"` // observations after the warm-up second
	P50Ms        float64 `json:"p50_ms"`
	P99Ms        float64 `json:"p99_ms"`
	P999Ms       float64 `json:"p999_ms"`
	MaxMs        float64 `json:"max_ms"`
	// Receive*: commit to the relay reading the transaction's row, which is
	// PostgreSQL's share of the latency (WAL flush, walsender, socket).
	ReceiveP50Ms  float64 `json:"receive_p50_ms"`
	ReceiveP99Ms  float64 `json:"receive_p99_ms"`
	ReceiveP999Ms float64 `json:"receive_p999_ms"`
	// DrainSeconds is how long after the writers stopped the last ack came.
	DrainSeconds float64 `json:"drain_seconds"`
	// MachineBusyPercent: all CPUs of the machine, everything included.
	MachineBusyPercent float64 `json:"machine_busy_percent"`
}

// LatencyResult is the live-latency part for one broker.
type LatencyResult struct {
	Broker string         `json:"broker"`
	Method string         `json:"method"`
	Phases []LatencyPhase `json:"phases"`
}

const insertSQL = `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
VALUES (gen_random_uuid(), 'order', $1, 'order.updated', $2::jsonb)`

// latency runs the relay in-process and commits single-row transactions at
// each rate, recording every commit-to-ack observation.
func (b *bench) latency(ctx context.Context, br *broker) (LatencyResult, error) {
	res := LatencyResult{Broker: br.name,
		Method: "relay in-process (relay.New with the default config); Metrics.CommitToAck replaced by a recorder of every observation; single-row transactions, synchronous_commit=on"}
	rates, _ := b.o.rateList()
	dsn, slot, topic, drop, err := b.liveSetup(ctx, br, "live")
	if err != nil {
		return res, err
	}
	defer drop()
	p := b.startInProcess(dsn, slot, br, topic, stderrWarnings())
	defer p.stop()
	if err := p.waitStreaming(ctx); err != nil {
		return res, err
	}
	pad := b.o.payload - len(payloadJSON(0, 0))
	// Warm up: the first record looks its topic up. Its acks are awaited
	// and dropped, so none is counted in the first rate.
	warm, _, err := writeAtRate(ctx, dsn, 500, 2*time.Second, 2, b.o.aggregates, pad)
	if err != nil {
		return res, err
	}
	if !p.rec.await(int(warm), 2*time.Minute, func() bool { return false }) {
		return res, fmt.Errorf("warm-up: %d of %d events acknowledged within 2 minutes", p.rec.count(), warm)
	}
	p.rec.take()
	p.recv.take()

	for rep := 1; rep <= b.o.repeat; rep++ {
		for _, rate := range rates {
			writers := b.o.writers
			if rate == 0 {
				writers *= 2
			}
			start, busy := time.Now(), startBusy()
			written, elapsed, err := writeAtRate(ctx, dsn, rate, b.o.latencyFor, writers, b.o.aggregates, pad)
			if err != nil {
				return res, err
			}
			end := time.Now()
			busyPercent := busy.percent()
			// Wait for the acks of everything written.
			p.rec.await(int(written), 2*time.Minute, func() bool { return false })
			drain := time.Since(end).Seconds()
			obs, received := p.rec.take(), p.recv.take()
			if len(obs) < int(written) {
				return res, fmt.Errorf("rate %s: %d of %d events acknowledged within 2 minutes", rateName(rate), len(obs), written)
			}
			if b.o.latencyDump != "" {
				if err := dumpObservations(b.o.latencyDump, fmt.Sprintf("%s-%d-%s.csv", br.name, rep, rateName(rate)), obs, start); err != nil {
					return res, err
				}
			}
			v := sortedLatencies(obs, start.Add(time.Second), end)
			rv := sortedLatencies(received, start.Add(time.Second), end)
			ph := LatencyPhase{
				Rep: rep, TargetRate: rate, Written: written, Seconds: elapsed.Seconds(),
				AchievedRate: float64(written) / elapsed.Seconds(), Measured: len(v),
				P50Ms: 1000 * percentile(v, 0.50), P99Ms: 1000 * percentile(v, 0.99),
				P999Ms: 1000 * percentile(v, 0.999), MaxMs: 1000 * percentile(v, 1),
				ReceiveP50Ms: 1000 * percentile(rv, 0.50), ReceiveP99Ms: 1000 * percentile(rv, 0.99),
				ReceiveP999Ms: 1000 * percentile(rv, 0.999),
				DrainSeconds:  drain, MachineBusyPercent: busyPercent,
			}
			b.logf("latency %s #%d at %s/s: achieved %.0f/s, p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.1f ms (%d events; machine %.0f%% busy); commit to receive p50 %.2f ms, p99 %.2f ms",
				br.name, rep, rateName(rate), ph.AchievedRate, ph.P50Ms, ph.P99Ms, ph.P999Ms, ph.MaxMs, ph.Measured, ph.MachineBusyPercent, ph.ReceiveP50Ms, ph.ReceiveP99Ms)
			res.Phases = append(res.Phases, ph)
			time.Sleep(time.Second) // a rest between rates, for the machine to settle
		}
	}
	return res, nil
}

// liveSetup creates a database with one slot and a fresh topic, all named
// after part and the broker, for a live-latency part; drop removes the
// database.
func (b *bench) liveSetup(ctx context.Context, br *broker, part string) (dsn, slot, topic string, drop func(), err error) {
	db := "bench_" + part + "_" + br.name
	dsn, err = b.createDB(ctx, db)
	if err != nil {
		return "", "", "", nil, err
	}
	drop = func() { b.dropDB(db) }
	slot = part + "_" + br.name
	if _, err := createSlots(ctx, dsn, []string{slot}); err != nil {
		drop()
		return "", "", "", nil, err
	}
	topic = fmt.Sprintf("bench.%s.%s.%d", part, br.name, time.Now().Unix())
	if err := br.createTopic(topic, b.o.partitions); err != nil {
		drop()
		return "", "", "", nil, err
	}
	return dsn, slot, topic, drop, nil
}

func rateName(rate int) string {
	if rate == 0 {
		return "max"
	}
	return fmt.Sprint(rate)
}

// payloadJSON is a payload like the backlog's, as jsonb prints it.
func payloadJSON(seq int, pad int) string {
	return fmt.Sprintf(`{"pad": "%s", "seq": %d, "amount": %d.%02d, "currency": "EUR", "customer": "cust-%d"}`,
		strings.Repeat("x", pad), seq, seq%100000/100, seq%100, seq%977)
}

// writeAtRate commits single-row transactions at rate per second (0: as
// fast as it can) for d, over `writers` connections. The schedule is
// open-loop: transaction k is due at start + k/rate, and a writer that falls
// behind catches up without sleeping.
func writeAtRate(ctx context.Context, dsn string, rate int, d time.Duration, writers, aggregates, pad int) (int64, time.Duration, error) {
	conns := make([]*pgx.Conn, writers)
	for i := range conns {
		c, err := pgx.Connect(ctx, dsn)
		if err != nil {
			return 0, 0, err
		}
		defer c.Close(context.Background())
		if _, err := c.Exec(ctx, "SET synchronous_commit = on"); err != nil {
			return 0, 0, err
		}
		conns[i] = c
	}
	var written atomic.Int64
	var seq atomic.Int64
	errs := make([]error, writers)
	var wg sync.WaitGroup
	start := time.Now()
	stopAt := start.Add(d)
	for w := range conns {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			c := conns[w]
			for k := w; ; k += writers {
				if rate > 0 {
					due := start.Add(time.Duration(float64(k) * float64(time.Second) / float64(rate)))
					if !due.Before(stopAt) {
						return
					}
					if wait := time.Until(due); wait > 0 {
						time.Sleep(wait)
					}
				} else if !time.Now().Before(stopAt) {
					return
				}
				n := int(seq.Add(1))
				if _, err := c.Exec(ctx, insertSQL, fmt.Sprintf("agg-%d", n%aggregates), payloadJSON(n, pad)); err != nil {
					errs[w] = err
					return
				}
				written.Add(1)
			}
		}(w)
	}
	wg.Wait()
	elapsed := time.Since(start)
	for _, err := range errs {
		if err != nil {
			return written.Load(), elapsed, fmt.Errorf("writer: %w", err)
		}
	}
	return written.Load(), elapsed, nil
}

// dumpObservations writes ack time (seconds since the rate started) and
// commit-to-ack latency (ms) per event, for plotting.
func dumpObservations(dir, name string, obs []observation, start time.Time) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var b strings.Builder
	b.WriteString("ack_s,latency_ms\n")
	for _, o := range obs {
		fmt.Fprintf(&b, "%.6f,%.3f\n", float64(o.ackNs-start.UnixNano())/1e9, o.latency*1000)
	}
	return os.WriteFile(filepath.Join(dir, name), []byte(b.String()), 0o644)
}
