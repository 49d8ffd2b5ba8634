package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/relay"
)

// shape is how the backlog is committed.
type shape struct {
	name   string
	key    string
	perTxn int
}

// ShapeResult is the ceiling comparison for one transaction shape.
type ShapeResult struct {
	Shape          string     `json:"shape"`
	RowsPerTxn     int        `json:"rows_per_txn"`
	Events         int        `json:"events"`
	PayloadBytes   float64    `json:"payload_bytes"`
	PrefillSeconds float64    `json:"prefill_seconds"`
	WALBytes       int64      `json:"wal_bytes"`
	EndLSN         string     `json:"end_lsn"`
	Runs           []DrainRun `json:"runs"`
	// Profile is the in-process pprof drain, when --profile was given;
	// ProfileEOS the same in exactly-once mode.
	Profile    *DrainRun `json:"profile,omitempty"`
	ProfileEOS *DrainRun `json:"profile_exactly_once,omitempty"`
}

// backlog creates a database and its slots, then commits the backlog.
func (b *bench) backlog(ctx context.Context, db string, slots []string, rows, perTxn int, sr *ShapeResult) (dsn string, end lsn.LSN, err error) {
	dsn, err = b.createDB(ctx, db)
	if err != nil {
		return "", 0, err
	}
	pad, err := padFor(ctx, dsn, b.o.payload)
	if err != nil {
		return "", 0, err
	}
	start, err := createSlots(ctx, dsn, slots)
	if err != nil {
		return "", 0, err
	}
	b.logf("%s: committing %d rows, %d per transaction, %d connections", db, rows, perTxn, b.o.prefillConns)
	t0 := time.Now()
	conns := b.o.prefillConns
	if rows/perTxn < 4*conns {
		conns = 1
	}
	end, err = fill(ctx, dsn, rows, perTxn, conns, b.o.aggregates, pad)
	if err != nil {
		return "", 0, err
	}
	sr.PrefillSeconds = time.Since(t0).Seconds()
	sr.WALBytes = int64(end - start)
	sr.EndLSN = end.String()
	if sr.PayloadBytes, err = payloadBytes(ctx, dsn); err != nil {
		return "", 0, err
	}
	b.logf("%s: backlog of %d rows in %.1fs (%.0f rows/s), %.0f MB of WAL, ends at %s", db, rows,
		sr.PrefillSeconds, float64(rows)/sr.PrefillSeconds, float64(sr.WALBytes)/1e6, end)
	return dsn, end, nil
}

// ceiling measures pg_recvlogical and the relay on one backlog.
func (b *bench) ceiling(ctx context.Context, sh shape) (ShapeResult, error) {
	sr := ShapeResult{Shape: sh.name, RowsPerTxn: sh.perTxn, Events: b.o.rows}
	db := "bench_" + sh.key
	var slots []string
	if !b.o.skip["ceiling"] {
		// Repetition 0 is the warm-up.
		for rep := 0; rep <= b.o.repeat; rep++ {
			if rep > 0 {
				slots = append(slots, fmt.Sprintf("recv_%d", rep), fmt.Sprintf("recv_after_%d", rep))
			}
			for _, br := range b.brokers {
				for vi := range b.catchUpVariants() {
					slots = append(slots, relaySlot("relay", br, vi, rep))
				}
			}
		}
	}
	profile := b.o.profileDir != ""
	if profile {
		slots = append(slots, "profile", "profile_eos")
	}
	if len(slots) == 0 {
		return sr, nil
	}
	dsn, end, err := b.backlog(ctx, db, slots, b.o.rows, sh.perTxn, &sr)
	if err != nil {
		return sr, err
	}
	defer b.dropDB(db)
	logDir, cleanup, err := b.logDirectory()
	if err != nil {
		return sr, err
	}
	defer cleanup()

	if !b.o.skip["ceiling"] {
		drain := func(rep int, br *broker, vi int, v variant) (DrainRun, error) {
			slot := relaySlot("relay", br, vi, rep)
			topic := fmt.Sprintf("bench.%s.%s.%d.%d.%d", sh.key, br.name, vi, rep, time.Now().Unix())
			r, err := b.drainRelay(ctx, dsn, slot, br, topic, v, b.o.rows, end, logDir)
			if err != nil {
				return r, fmt.Errorf("relay/%s: %w", br.name, err)
			}
			r.Rep = rep
			b.dropSlot(ctx, dsn, slot)
			return r, nil
		}
		// Each mode drains once before the measured repetitions, discarded:
		// the first drains on a fresh broker paid for its warm-up (topic
		// and transaction-log creation, the JIT), which favoured whichever
		// mode ran later.
		for _, br := range b.brokers {
			for vi, v := range b.catchUpVariants() {
				r, err := drain(0, br, vi, v)
				if err != nil {
					return sr, err
				}
				b.logf("%s warm-up (discarded): %s %.1fs, %.0f events/s, peak RSS %.1f MB", sh.name, r.label(), r.Seconds, r.EventsPerSec, r.PeakRSSMB)
			}
		}
		for rep := 1; rep <= b.o.repeat; rep++ {
			// pg_recvlogical runs before the relays and again after them, and
			// the ratio takes the faster run: which reader goes first (cold
			// caches, a fresh walsender) must not favour the relay.
			recv := func(slot, variant string) error {
				r, err := b.drainRecvLogical(ctx, dsn, slot, b.o.rows, end)
				if err != nil {
					return err
				}
				r.Rep, r.Variant = rep, variant
				b.logf("%s #%d: %s %.1fs, %.0f events/s (walsender %.1f µs/event)", sh.name, rep, r.label(), r.Seconds, r.EventsPerSec, r.WalsenderCPUUsPerEvent)
				sr.Runs = append(sr.Runs, r)
				b.dropSlot(ctx, dsn, slot)
				return nil
			}
			if err := recv(fmt.Sprintf("recv_%d", rep), ""); err != nil {
				return sr, err
			}
			for _, br := range b.brokers {
				for _, vi := range variantOrder(len(b.catchUpVariants()), rep) {
					r, err := drain(rep, br, vi, b.catchUpVariants()[vi])
					if err != nil {
						return sr, err
					}
					b.logf("%s #%d: %s %.1fs (all acked at %.1fs), %.0f events/s, %.2f µs CPU/event, peak RSS %.1f MB, first confirm %.3fs, first visible %.3fs after streaming, machine %.0f%% busy%s", sh.name, rep, r.label(),
						r.Seconds, r.AckedSeconds, r.EventsPerSec, r.CPUUsPerEvent, r.PeakRSSMB, r.FirstConfirmAfter, r.FirstVisibleAfter, r.MachineBusyPercent, nudged(r.Nudged))
					sr.Runs = append(sr.Runs, r)
				}
			}
			if err := recv(fmt.Sprintf("recv_after_%d", rep), "after"); err != nil {
				return sr, err
			}
		}
	}
	if profile {
		br := b.profileBroker()
		r, err := b.profileDrain(ctx, dsn, "profile", sh.key, br, b.o.rows, end, "")
		if err != nil {
			return sr, fmt.Errorf("profile: %w", err)
		}
		sr.Profile = &r
		r, err = b.profileDrain(ctx, dsn, "profile_eos", sh.key+"-eos", br, b.o.rows, end, relay.DeliveryExactlyOnce)
		if err != nil {
			return sr, fmt.Errorf("profile, exactly-once: %w", err)
		}
		sr.ProfileEOS = &r
	}
	return sr, nil
}

// variantOrder is the order n variants drain in repetition rep: as given
// on odd repetitions, reversed on even ones, so that no mode always drains
// right after the same neighbour (whose leftovers, a broker still writing
// transaction markers or a collecting JVM, it would pay for).
func variantOrder(n, rep int) []int {
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	if rep%2 == 0 {
		slices.Reverse(order)
	}
	return order
}

// catchUpVariants are the relay variants that drain each backlog: every
// variant as given, then, unless --skip eos, each again with
// --delivery exactly-once, side by side in the same repetition. Against
// Apache Kafka this is where the cost of transactions shows; kfake's cost
// almost nothing.
func (b *bench) catchUpVariants() []variant {
	vs := slices.Clone(b.o.variants)
	if b.o.skip["eos"] {
		return vs
	}
	for _, v := range b.o.variants {
		vs = append(vs, variant{name: eosVariantName(v.name), bin: v.bin, env: append(slices.Clone(v.env), eosDeliveryEnv)})
	}
	return vs
}

// eosVariantName names the exactly-once twin of a variant.
func eosVariantName(name string) string {
	if name == "" {
		return "exactly-once"
	}
	return name + "+exactly-once"
}

func nudged(n bool) string {
	if n {
		return " (nudged)"
	}
	return ""
}

func (b *bench) dropSlot(ctx context.Context, dsn, slot string) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return
	}
	defer conn.Close(context.Background())
	// The walsender may take a moment to let go of the slot.
	for i := 0; i < 50; i++ {
		if _, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", slot); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// BigTxnResult is the relay delivering one very large transaction.
type BigTxnResult struct {
	Events         int        `json:"events"`
	PrefillSeconds float64    `json:"prefill_seconds"`
	WALBytes       int64      `json:"wal_bytes"`
	Runs           []DrainRun `json:"runs"`
}

// bigTxn measures the relay delivering one transaction of 2×rows rows.
func (b *bench) bigTxn(ctx context.Context) (*BigTxnResult, error) {
	rows := 2 * b.o.rows
	res := &BigTxnResult{Events: rows}
	var slots []string
	for rep := 1; rep <= b.o.repeat; rep++ {
		for _, br := range b.brokers {
			for vi := range b.o.variants {
				slots = append(slots, relaySlot("big", br, vi, rep))
			}
		}
	}
	db := "bench_bigtxn"
	var sr ShapeResult
	dsn, end, err := b.backlog(ctx, db, slots, rows, rows, &sr)
	if err != nil {
		return nil, err
	}
	defer b.dropDB(db)
	res.PrefillSeconds, res.WALBytes = sr.PrefillSeconds, sr.WALBytes
	logDir, cleanup, err := b.logDirectory()
	if err != nil {
		return nil, err
	}
	defer cleanup()
	for rep := 1; rep <= b.o.repeat; rep++ {
		for _, br := range b.brokers {
			for vi, v := range b.o.variants {
				slot := relaySlot("big", br, vi, rep)
				topic := fmt.Sprintf("bench.bigtxn.%s.%d.%d.%d", br.name, vi, rep, time.Now().Unix())
				r, err := b.drainRelay(ctx, dsn, slot, br, topic, v, rows, end, logDir)
				if err != nil {
					return nil, fmt.Errorf("relay/%s: %w", br.name, err)
				}
				r.Rep = rep
				b.logf("one transaction of %d rows #%d: %s %.1fs, %.0f events/s, %.2f µs CPU/event, peak RSS %.1f MB, machine %.0f%% busy%s", rows, rep, r.label(),
					r.Seconds, r.EventsPerSec, r.CPUUsPerEvent, r.PeakRSSMB, r.MachineBusyPercent, nudged(r.Nudged))
				res.Runs = append(res.Runs, r)
				b.dropSlot(ctx, dsn, slot)
			}
		}
	}
	return res, nil
}

// logDirectory is where relay subprocess logs go: --logs, or a temporary
// directory removed afterwards.
func (b *bench) logDirectory() (string, func(), error) {
	if b.o.logDir != "" {
		return b.o.logDir, func() {}, os.MkdirAll(b.o.logDir, 0o755)
	}
	dir, err := os.MkdirTemp("", "outbox-relay-bench-logs-")
	if err != nil {
		return "", nil, err
	}
	return dir, func() { os.RemoveAll(dir) }, nil
}

// relaySlot names the slot of one relay drain.
func relaySlot(prefix string, br *broker, variant, rep int) string {
	if variant == 0 {
		return fmt.Sprintf("%s_%s_%d", prefix, br.name, rep)
	}
	return fmt.Sprintf("%s_%s_v%d_%d", prefix, br.name, variant, rep)
}
