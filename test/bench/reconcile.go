package main

import (
	"bytes"
	"context"
	"crypto/md5"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
)

// ReconcileResult is one `outbox-relay reconcile` over a window of
// --reconcile-rows rows, of which every 1000th has no record in Kafka.
type ReconcileResult struct {
	Broker     string  `json:"broker"`
	Rows       int     `json:"rows"`
	Planted    int     `json:"planted_missing"`
	Checked    int64   `json:"rows_checked"`
	Reported   int     `json:"reported_missing"`
	ExitCode   int     `json:"exit_code"`
	Seconds    float64 `json:"seconds"`
	RowsPerSec float64 `json:"rows_per_second"`
	PeakRSSMB  float64 `json:"peak_rss_mb"`
	CPUSeconds float64 `json:"cpu_seconds"`
	Correct    bool    `json:"correct"`
}

// plantedEvery: every this many rows, one gets no record, so the run must
// report exactly rows/plantedEvery missing events.
const plantedEvery = 1000

// benchEventID is the event_id of row g, computed the same way in SQL
// (md5('r' || g)::uuid) and here, so records can be produced without
// reading the ids back.
func benchEventID(g int) string {
	sum := md5.Sum([]byte("r" + strconv.Itoa(g)))
	h := hex.EncodeToString(sum[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// reconcileWindow fills a table, produces the matching records straight to
// the broker (all but the planted gaps), and times the relay binary's
// `reconcile` over the whole window; peak RSS is the child's ru_maxrss.
func (b *bench) reconcileWindow(ctx context.Context, br *broker) (ReconcileResult, error) {
	n := b.o.reconcileRows
	res := ReconcileResult{Broker: br.name, Rows: n, Planted: n / plantedEvery}
	db := "bench_reconcile_" + br.name
	dsn, err := b.createDB(ctx, db)
	if err != nil {
		return res, err
	}
	defer b.dropDB(db)
	topic := fmt.Sprintf("bench-reconcile-%s-%d", br.name, time.Now().UnixNano())
	if err := br.createTopic(topic, b.o.partitions); err != nil {
		return res, err
	}

	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return res, err
	}
	defer conn.Close(context.Background())
	var since time.Time
	if err := conn.QueryRow(ctx, "SELECT now() - interval '1 second'").Scan(&since); err != nil {
		return res, err
	}
	b.logf("reconcile, %s: committing %d rows", br.name, n)
	const chunk = 100_000
	for first := 0; first < n; first += chunk {
		if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
			SELECT md5('r' || g)::uuid, 'order', 'agg-' || (g % $3), 'order.updated', jsonb_build_object('seq', g)
			FROM generate_series($1::bigint, $2::bigint) AS g`, first, min(first+chunk, n)-1, b.o.aggregates); err != nil {
			return res, fmt.Errorf("fill: %w", err)
		}
	}

	b.logf("reconcile, %s: producing %d records", br.name, n-res.Planted)
	var failed atomic.Value
	for g := 0; g < n; g++ {
		if g%plantedEvery == plantedEvery-1 {
			continue
		}
		r := &kgo.Record{Topic: topic, Key: []byte("agg-" + strconv.Itoa(g%b.o.aggregates)), Value: []byte(`{"seq":` + strconv.Itoa(g) + `}`),
			Headers: []kgo.RecordHeader{{Key: "event_id", Value: []byte(benchEventID(g))}}}
		br.cl.Produce(ctx, r, func(_ *kgo.Record, err error) {
			if err != nil {
				failed.CompareAndSwap(nil, err)
			}
		})
	}
	if err := br.cl.Flush(ctx); err != nil {
		return res, err
	}
	if err, _ := failed.Load().(error); err != nil {
		return res, fmt.Errorf("produce: %w", err)
	}

	b.logf("reconcile, %s: outbox-relay reconcile over %d rows", br.name, n)
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, b.relayBin, "reconcile", "--json", "--pg-dsn", dsn, "--kafka-brokers", br.list(),
		"--topic", topic, "--since", since.UTC().Format(time.RFC3339Nano), "--until", "0s", "--log-level", "warn")
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err = cmd.Run()
	res.Seconds = time.Since(start).Seconds()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		return res, fmt.Errorf("run reconcile: %w", err)
	}
	res.ExitCode = cmd.ProcessState.ExitCode()
	if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
		res.PeakRSSMB = float64(ru.Maxrss) / 1024
		res.CPUSeconds = time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
	}
	var report struct {
		RowsChecked int64             `json:"rows_checked"`
		Missing     []json.RawMessage `json:"missing"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &report); err != nil {
		return res, fmt.Errorf("reconcile exited %d without a JSON report: %v; stderr: %s", res.ExitCode, err, lastBytes(stderr.Bytes(), 2000))
	}
	res.Checked, res.Reported = report.RowsChecked, len(report.Missing)
	res.RowsPerSec = float64(n) / res.Seconds
	res.Correct = res.ExitCode == 3 && res.Checked == int64(n) && res.Reported == res.Planted
	if !res.Correct {
		b.res.Problems = append(b.res.Problems, fmt.Sprintf("reconcile on %s: exit %d, checked %d of %d rows, reported %d of %d planted missing events",
			br.name, res.ExitCode, res.Checked, n, res.Reported, res.Planted))
	}
	b.logf("reconcile, %s: %.1f s, %.0f rows/s, peak RSS %.0f MB, CPU %.1f s", br.name, res.Seconds, res.RowsPerSec, res.PeakRSSMB, res.CPUSeconds)
	return res, nil
}

func lastBytes(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// reconcileMarkdown is the results section of the reconcile part.
func (r *Results) reconcileMarkdown(w func(string, ...any)) {
	if len(r.Reconcile) == 0 {
		return
	}
	w("\n## Reconcile: comparing a window with Kafka\n\n")
	w("`outbox-relay reconcile --json` over a window of N rows (one per row of a fresh table, one topic), whose records were produced straight to the broker except every %dth, which must come back as missing. Time is the process's wall time; peak RSS is its ru_maxrss.\n\n", plantedEvery)
	w("| broker | rows | rows checked | missing planted / reported | exit | seconds | rows/s | peak RSS MB | CPU s | correct |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for _, c := range r.Reconcile {
		w("| %s | %d | %d | %d / %d | %d | %.1f | %.0f | %.0f | %.1f | %v |\n", c.Broker, c.Rows, c.Checked, c.Planted, c.Reported,
			c.ExitCode, c.Seconds, c.RowsPerSec, c.PeakRSSMB, c.CPUSeconds, c.Correct)
	}
}
