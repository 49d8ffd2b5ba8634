package drills

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// recoverFlags run the relay with --on-slot-lost recover, writing its
// progress often.
var recoverFlags = []string{"--on-slot-lost", "recover", "--status-interval", "300ms"}

// Log lines of a recovery of a lost slot.
const (
	msgRecovering = "the replication slot is lost; recovering it from the outbox table"
	msgRecovered  = "recovered the lost replication slot"
)

// deliveryModes are the drills' subtests: the relay in each delivery mode.
var deliveryModes = []string{"at-least-once", "exactly-once"}

// modeFlags are recoverFlags for a delivery mode.
func modeFlags(mode string) []string {
	flags := append([]string(nil), recoverFlags...)
	if mode == "exactly-once" {
		flags = append(flags, eosFlags...)
	}
	return flags
}

// TestDrillRecoverDroppedSlot drops the slot under a streaming relay while
// a writer commits without pause (issue 42, drill a). With --on-slot-lost
// recover the relay must make a new slot, republish from the outbox table
// every event the old slot had not delivered, and stream again, with no
// operator: an independent client then finds every committed event, in
// per-aggregate order, and in exactly-once mode read_committed readers see
// each exactly once.
func TestDrillRecoverDroppedSlot(t *testing.T) {
	for _, mode := range deliveryModes {
		t.Run(mode, func(t *testing.T) {
			rng := newRand(t)
			w, _ := newKfakeWorld(t, shared)
			relay := w.startRelay(modeFlags(mode)...)
			conn := w.connect()
			pw := startPacedWriter(w, conn, mrand.New(mrand.NewPCG(rng.Uint64(), 1)), 10*time.Millisecond, 5, 50, false)
			defer pw.halt()
			harness.WaitFor(t, time.Minute, "300 events committed", func() bool { return pw.events.Load() >= 300 })

			streams := strings.Count(relay.Output(), harness.LogStreaming)
			lostAt := dropSlotUnder(t, w)
			back := waitRecovered(t, relay, streams, lostAt)
			writeOnAfterRecovery(t, pw)
			checkRecovered(t, w, relay, mode, back)
		})
	}
}

// TestDrillRecoverInvalidatedSlot stops the relay, lets the writer go on,
// and makes PostgreSQL invalidate the slot (max_slot_wal_keep_size) before
// the relay starts again (issue 42, drill b). The events committed while it
// was down are in no slot; the relay must republish them from the table
// and stream on, with no operator.
func TestDrillRecoverInvalidatedSlot(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{Settings: map[string]string{
		"max_slot_wal_keep_size": "1MB",
		"wal_keep_size":          "0",
		"max_wal_size":           "32MB",
		"min_wal_size":           "32MB",
	}})
	for _, mode := range deliveryModes {
		t.Run(mode, func(t *testing.T) {
			rng := newRand(t)
			w, _ := newKfakeWorld(t, pg)
			w.DB.Exec(t, "CREATE TABLE filler (id bigserial PRIMARY KEY, v text)")
			relay := w.startRelay(modeFlags(mode)...)
			conn := w.connect()
			// Slow enough that the new slot, which the relay holds without
			// streaming while it republishes, stays within 1 MB of WAL.
			pw := startPacedWriter(w, conn, mrand.New(mrand.NewPCG(rng.Uint64(), 1)), 20*time.Millisecond, 5, 50, false)
			defer pw.halt()
			harness.WaitFor(t, time.Minute, "200 events committed", func() bool { return pw.events.Load() >= 200 })
			if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
				t.Fatalf("relay exited %d (%v) on SIGTERM, want 0", code, err)
			}
			downAt := pw.events.Load()
			harness.WaitFor(t, 3*time.Minute, "PostgreSQL invalidates the slot", func() bool {
				w.DB.Exec(t, "INSERT INTO filler (v) SELECT repeat('f', 1000) FROM generate_series(1, 4000)")
				w.DB.Exec(t, "SELECT pg_switch_wal()")
				w.DB.Exec(t, "CHECKPOINT")
				return pg.SlotInfo(t, w.DB.Name(), w.Slot).WALStatus == "lost"
			})
			lostAt := time.Now()
			t.Logf("%d events committed while the relay was down and the slot was invalidated", pw.events.Load()-downAt)

			relay = w.startRelayNoWait(modeFlags(mode)...)
			back := waitRecovered(t, relay, 0, lostAt)
			writeOnAfterRecovery(t, pw)
			checkRecovered(t, w, relay, mode, back)
		})
	}
}

// TestDrillRecoverAfterPromotionWithoutSlot promotes a standby that never
// had the slot, as on PostgreSQL 15 and 16 (which have no failover slots)
// or on 17+ with a slot that is not a failover slot (issue 42, drill c).
// The relay is SIGKILLed 100 events before the primary dies and starts
// again once the standby is promoted, so the gap is real: those events
// are in the table and nowhere else.
// The relay, given both servers with target_session_attrs=read-write,
// connects to the promoted server, finds no slot there, and must recover
// from the table the events the old primary had not delivered: no loss,
// per-aggregate order, and in exactly-once mode no duplicate for
// read_committed readers. Commits are synchronous to the standby, so every
// event whose commit returned is on it.
func TestDrillRecoverAfterPromotionWithoutSlot(t *testing.T) {
	for _, mode := range deliveryModes {
		t.Run(mode, func(t *testing.T) {
			rng := newRand(t)
			pg := harness.StartPostgres(t, harness.PGOptions{})
			w := newWorld(t, pg, nil)
			k := startKfake(t, harness.KfakeOptions{}, w.topics())
			w.Brokers = k.Brokers()
			const standbySlot = "relay_plain_standby"
			standby := pg.CopyStandby(t, standbySlot, nil)
			pg.Exec(t, fmt.Sprintf("ALTER SYSTEM SET synchronous_standby_names = '%s'", standbySlot))
			pg.Exec(t, "SELECT pg_reload_conf()")
			w.Migrate() // the slot is made on the primary only, and is not a failover slot
			w.relayDSN = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/%s?target_session_attrs=read-write",
				pg.Port(), standby.Port(), w.DB.Name())

			relay := w.startRelay(modeFlags(mode)...)
			conn := w.connect()
			pw := startPacedWriter(w, conn, mrand.New(mrand.NewPCG(rng.Uint64(), 1)), 10*time.Millisecond, 5, 50, false)
			defer pw.halt()
			harness.WaitFor(t, time.Minute, "300 events committed", func() bool { return pw.events.Load() >= 300 })
			// The relay's host dies first and the writer goes on, so the
			// events committed meanwhile are on the standby, in no slot,
			// and not in Kafka when the primary dies too.
			relay.Kill()
			killedAt := pw.events.Load()
			harness.WaitFor(t, time.Minute, "100 events committed while no relay runs", func() bool { return pw.events.Load() >= killedAt+100 })

			pg.StopImmediate(t)
			werr := pw.halt()
			lostAt := time.Now()
			standby.Promote(t)
			n := w.on(standby)
			n.Ledger = w.Ledger
			pw.doubt.settle(t, n)
			if got := standby.QueryString(t, "SELECT coalesce((SELECT slot_name FROM pg_replication_slots WHERE slot_name = $1), '')", w.Slot); got != "" {
				t.Fatalf("the promoted standby has slot %s: the drill needs one without it", got)
			}
			t.Logf("PostgreSQL %d: primary stopped with -m immediate after %d events (writer: %v)", standby.Major(t), w.CommittedCount(), werr)

			relay = w.startRelayNoWait(modeFlags(mode)...)
			back := waitRecovered(t, relay, 0, lostAt)
			nconn := n.connect()
			if err := n.writeTxns(nconn, rng, 20, 5, 50); err != nil {
				t.Fatal(err)
			}
			checkRecovered(t, n, relay, mode, back)
		})
	}
}

// TestDrillRecoverRefusesDeletedWindow: when rows of the gap were deleted
// (here by hand, as a retention job run past the relay's progress would),
// the table cannot cover the gap. The relay must stop, say exactly that and
// what to do, and leave no new slot holding WAL and no mark in the
// progress record. Issue 51.7: what it says to do is then followed
// literally while a writer commits 200 events/s throughout. Its old advice
// (reconcile up to now, then a new slot) lost the 716 events committed
// between the two; --existing-rows pending makes the slot first.
func TestDrillRecoverRefusesDeletedWindow(t *testing.T) {
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	conn := w.connect()
	publishThenDropSlot(t, w, conn, rng)
	w.DB.Exec(t, "DELETE FROM outbox_events")
	pw := startPacedWriter(w, w.connect(), mrand.New(mrand.NewPCG(rng.Uint64(), 1)), 10*time.Millisecond, 2, 50, false)
	defer pw.halt()
	harness.WaitFor(t, time.Minute, "100 events newer than the progress", func() bool { return pw.events.Load() >= 100 })

	p := w.startRelayNoWait(recoverFlags...)
	code, err := p.Wait(2 * time.Minute)
	if err != nil {
		t.Fatalf("the relay kept running on a gap the table cannot cover: %v\n%s", err, harness.LastLines(p.Output(), 20))
	}
	out := p.Output()
	if code != 1 {
		t.Errorf("relay exited %d on a gap the table cannot cover, want 1", code)
	}
	for _, want := range []string{"cannot be recovered from the outbox table", "rows were deleted", "its oldest row was created at",
		"--existing-rows pending", "--existing-rows published"} {
		if !strings.Contains(out, want) {
			t.Errorf("the refusal does not say %q:\n%s", want, harness.LastLines(out, 20))
		}
	}
	if strings.Contains(out, msgRecovering) {
		t.Errorf("the relay began a recovery before finding the window deleted:\n%s", harness.LastLines(out, 20))
	}
	if si := w.pg.SlotInfo(t, w.DB.Name(), w.Slot); si.Exists {
		t.Errorf("the refusal left slot %s (%+v): a slot nobody streams holds WAL", w.Slot, si)
	}
	if rec := latestProgress(t, w.Brokers, w.Slot); rec.RecoverySince != "" {
		t.Errorf("the refusal marked the progress record as recovering since %s", rec.RecoverySince)
	}
	t.Logf("refused with exit %d: %s", code, lastLogMessage(out))

	// The way out it names, as an operator would type it: the same command
	// with --existing-rows pending added.
	relay := w.startRelayNoWait(append(recoverFlags, "--existing-rows", "pending")...)
	back := waitRecovered(t, relay, 0, time.Now())
	writeOnAfterRecovery(t, pw)
	checkRecovered(t, w, relay, "at-least-once", back)
}

// TestDrillRecoverKilledMidway SIGKILLs the relay in the middle of a
// recovery, once it has marked the progress record and before it
// finished. A relay started with --on-slot-lost stop must then refuse to
// stream past the unfinished recovery; one started with recover must
// finish it, with no event lost.
func TestDrillRecoverKilledMidway(t *testing.T) {
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	conn := w.connect()
	publishThenDropSlot(t, w, conn, rng)
	if err := w.writeTxns(conn, rng, 50, 5, 20); err != nil { // the gap
		t.Fatal(err)
	}

	// A transaction holding an xid keeps CREATE_REPLICATION_SLOT waiting
	// until it ends, so the relay is held between its mark and its new
	// slot, and the kill lands there however fast the machine is.
	ctx := context.Background()
	holder, err := w.connect().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, "SELECT pg_current_xact_id()"); err != nil {
		t.Fatal(err)
	}
	creating := func() int64 {
		return w.DB.QueryInt64(t, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender' AND datname = current_database() AND query LIKE 'CREATE_REPLICATION_SLOT%'")
	}
	p := w.startRelayNoWait(recoverFlags...)
	p.WaitForOutput(t, msgRecovering, 2*time.Minute)
	harness.WaitFor(t, time.Minute, "the relay's CREATE_REPLICATION_SLOT waits for the open transaction", func() bool {
		return p.Exited() || creating() > 0
	})
	p.Kill()
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// The killed relay's walsender finds out only once the slot is made.
	harness.WaitFor(t, time.Minute, "the killed relay's walsender ends", func() bool {
		return creating() == 0 && !w.pg.SlotInfo(t, w.DB.Name(), w.Slot).Active
	})
	rec := latestProgress(t, w.Brokers, w.Slot)
	if rec.RecoverySince == "" {
		t.Fatalf("the progress record is not marked as recovering after the relay was killed in a recovery: %+v\n%s", rec, harness.LastLines(p.Output(), 20))
	}

	refuseStop := func(what string) {
		t.Helper()
		stop := w.startRelayNoWait("--on-slot-lost", "stop")
		code, err := stop.Wait(2 * time.Minute)
		if err != nil {
			t.Fatalf("a relay with --on-slot-lost stop streamed past an unfinished recovery (%s): %v\n%s", what, err, harness.LastLines(stop.Output(), 20))
		}
		if out := stop.Output(); code != 1 || !strings.Contains(out, "marks a recovery of the lost slot that began and did not finish") ||
			!strings.Contains(out, "--on-slot-lost recover") {
			t.Errorf("--on-slot-lost stop after an unfinished recovery (%s): exit %d, want 1 naming the recovery and what to do:\n%s", what, code, harness.LastLines(out, 20))
		}
	}
	refuseStop("its slot made")
	// Issue 51's hostile review: killed before its slot existed, the
	// recovery left only the mark, and a start with stop made a slot over
	// the gap with no record before refusing the mark; once the mark was
	// gone (the progress topic deleted) a plain start streamed from that
	// slot and the gap was lost. Nothing may be made before the refusal.
	w.DB.DropSlot(t, w.Slot)
	refuseStop("its slot not made")
	if si := w.pg.SlotInfo(t, w.DB.Name(), w.Slot); si.Exists {
		t.Fatalf("--on-slot-lost stop made slot %s over an unfinished recovery's gap before refusing", w.Slot)
	}

	relay := w.startRelayNoWait(recoverFlags...)
	relay.WaitForOutput(t, msgRecovered, 2*time.Minute)
	relay.WaitForOutput(t, harness.LogStreaming, time.Minute)
	if rec := latestProgress(t, w.Brokers, w.Slot); rec.RecoverySince != "" {
		t.Errorf("the finished recovery left the progress record marked: %+v", rec)
	}
	if err := w.writeTxns(conn, rng, 10, 5, 20); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(2 * time.Minute)
	w.checkDelivery(records)
	t.Logf("%d events, %d records after a recovery killed midway and finished by the next start", w.CommittedCount(), len(records))
}

// publishThenDropSlot runs a recovering relay until Kafka holds 100 events
// and the progress record covers them, stops it with SIGTERM, and drops
// its slot while no relay runs: the next relay finds the slot missing and
// Kafka holding progress for it. The relay runs with flags, recoverFlags
// when none are given.
func publishThenDropSlot(t *testing.T, w *world, conn *pgx.Conn, rng *mrand.Rand, flags ...string) {
	t.Helper()
	if len(flags) == 0 {
		flags = recoverFlags
	}
	relay := w.startRelay(flags...)
	if err := w.writeTxns(conn, rng, 20, 5, 20); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute)
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("relay exited %d (%v) on SIGTERM, want 0", code, err)
	}
	w.DB.DropSlot(t, w.Slot)
}

// dropSlotUnder drops the slot under a relay that streams from it: it ends
// the walsender and drops the slot before the relay reconnects, as often
// as the relay wins that race, and returns when the slot went.
func dropSlotUnder(t *testing.T, w *world) time.Time {
	t.Helper()
	var dropped time.Time
	harness.WaitFor(t, 30*time.Second, "the slot dropped under the relay", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, w.DB.DSN())
		if err != nil {
			return false
		}
		defer conn.Close(context.Background())
		// pg_terminate_backend waits up to 5 s for the walsender to exit.
		if _, err := conn.Exec(ctx, "SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL", w.Slot); err != nil {
			return false
		}
		if _, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", w.Slot); err != nil {
			return false // the relay took the slot again first
		}
		dropped = time.Now()
		return true
	})
	return dropped
}

// waitRecovered waits until the relay logged a finished recovery and
// streams again (more than streams times) and returns how long that took
// from lostAt.
func waitRecovered(t *testing.T, relay *harness.Process, streams int, lostAt time.Time) time.Duration {
	t.Helper()
	harness.WaitFor(t, 3*time.Minute, "the relay recovers the slot and streams again", func() bool {
		out := relay.Output()
		return relay.Exited() || strings.Contains(out, msgRecovered) && strings.Count(out, harness.LogStreaming) > streams
	})
	if relay.Exited() {
		t.Fatalf("the relay exited instead of recovering the slot:\n%s", harness.LastLines(relay.Output(), 30))
	}
	return time.Since(lostAt)
}

// writeOnAfterRecovery lets the paced writer commit 300 more events on the
// recovered slot, then stops it.
func writeOnAfterRecovery(t *testing.T, pw *pacedWriter) {
	t.Helper()
	after := pw.events.Load()
	harness.WaitFor(t, time.Minute, "300 more events committed after the recovery", func() bool { return pw.events.Load() >= after+300 })
	if err := pw.halt(); err != nil {
		t.Fatal(err)
	}
}

// checkRecovered checks, with the independent client, every event w
// committed: no loss and per-aggregate order, and in exactly-once mode each
// exactly once for read_committed readers. It checks that the relay
// recovered once and logs what the recovery did and how long the relay was
// without a slot.
func checkRecovered(t *testing.T, w *world, relay *harness.Process, mode string, back time.Duration) {
	t.Helper()
	var records []harness.Record
	if mode == "exactly-once" {
		records = w.settleExactlyOnce(2 * time.Minute)
		checkTxnsCommitted(t, relay.Output())
	} else {
		records = w.waitSettled(2 * time.Minute)
		w.checkDelivery(records)
	}
	var recoveries []harness.LogLine
	for _, l := range harness.LogLines(relay.Output()) {
		if strings.HasPrefix(l.Str("message"), msgRecovered) {
			recoveries = append(recoveries, l)
		}
	}
	if len(recoveries) != 1 {
		t.Fatalf("the relay logged %d finished recoveries, want 1", len(recoveries))
	}
	l := recoveries[0]
	republished, _ := strconv.Atoi(l.Str("republished"))
	missing, _ := strconv.Atoi(l.Str("missing"))
	if republished != missing {
		t.Errorf("the recovery republished %d of the %d events Kafka lacked", republished, missing)
	}
	redelivered := len(records) - len(harness.FirstDeliveries(records))
	t.Logf("%s: %d events, %d records (%d re-delivered); recovery checked %s rows, found %s in Kafka, republished %d, took %s; streaming again %v after the slot was lost",
		mode, w.CommittedCount(), len(records), redelivered, l.Str("rows_checked"), l.Str("found_in_kafka"), republished, l.Str("took"), back.Round(time.Millisecond))
}
