package drills

import (
	"context"
	mrand "math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// The refusal of a slot that a lost history would hide, and the choice it
// asks for.
const (
	msgExistingRows = "the relay will not make a slot over rows it has no record of publishing"
	adviceExisting  = "--existing-rows pending"
)

// loseHistory runs a relay with flags under a paced writer until 300
// events are committed, stops it with SIGTERM, drops its slot while the
// writer goes on, and, with dropProgress, deletes the progress topic:
// what is left is the outbox table, Kafka's events and the slot's record
// in PostgreSQL. It returns the writer, still writing, and when the slot
// went.
func loseHistory(t *testing.T, w *world, rng *mrand.Rand, dropProgress bool, flags ...string) (*pacedWriter, time.Time) {
	t.Helper()
	relay := w.startRelay(flags...)
	pw := startPacedWriter(w, w.connect(), mrand.New(mrand.NewPCG(rng.Uint64(), 1)), 10*time.Millisecond, 5, 50, false)
	harness.WaitFor(t, time.Minute, "300 events committed", func() bool { return pw.events.Load() >= 300 })
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("relay exited %d (%v) on SIGTERM, want 0", code, err)
	}
	w.DB.DropSlot(t, w.Slot)
	lostAt := time.Now()
	downAt := pw.events.Load()
	harness.WaitFor(t, time.Minute, "300 events committed with no slot", func() bool { return pw.events.Load() >= downAt+300 })
	if dropProgress {
		harness.DeleteTopic(t, w.Brokers, progressTopic)
	}
	return pw, lostAt
}

// expectRefusal waits for a relay or migrate to exit 1 with the refusal of
// a slot over a lost history, naming the choices, and to leave no slot.
func expectRefusal(t *testing.T, w *world, p *harness.Process, what string) {
	t.Helper()
	code, err := p.Wait(2 * time.Minute)
	if err != nil {
		p.Kill()
		t.Fatalf("%s went on over a lost history instead of refusing: %v\n%s", what, err, harness.LastLines(p.Output(), 20))
	}
	out := p.Output()
	if code != 1 || !strings.Contains(out, msgExistingRows) || !strings.Contains(out, adviceExisting) || !strings.Contains(out, "--existing-rows published") {
		t.Errorf("%s over a lost history: exit %d, want 1 with the refusal and both choices:\n%s", what, code, harness.LastLines(out, 20))
	}
	if si := w.pg.SlotInfo(t, w.DB.Name(), w.Slot); si.Exists {
		t.Errorf("%s refused but left slot %s, which hides the gap from the next start", what, w.Slot)
	}
	t.Logf("%s refused with exit %d: %s", what, code, lastLogMessage(out))
}

// Issue 51.1: --on-slot-lost recover took a lost history for a first
// start. Slot dropped while the relay was down, the writer going on, and
// the progress topic deleted: the relay logged one warning, made a new
// slot and streamed, and the 300 events committed meanwhile never reached
// Kafka. The slot's record in PostgreSQL now says it existed, and since
// when its events may be missing: the relay recovers from there.
func TestDrillRecoverLostHistoryWithoutProgress(t *testing.T) {
	for _, mode := range deliveryModes {
		t.Run(mode, func(t *testing.T) {
			rng := newRand(t)
			w, _ := newKfakeWorld(t, shared)
			pw, lostAt := loseHistory(t, w, rng, true, modeFlags(mode)...)
			defer pw.halt()
			relay := w.startRelayNoWait(modeFlags(mode)...)
			back := waitRecovered(t, relay, 0, lostAt)
			writeOnAfterRecovery(t, pw)
			checkRecovered(t, w, relay, mode, back)
		})
	}
}

// Issue 51.1 and 51.7: with --on-slot-lost stop the same lost history
// must stop the relay, naming the choices; and the choice it names,
// followed literally while the writer keeps writing, must lose nothing.
// (The refusal's old advice, reconcile first and a new slot after, lost
// the 716 events committed in between.)
func TestDrillLostHistoryRefusedThenPending(t *testing.T) {
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	pw, lostAt := loseHistory(t, w, rng, true)
	defer pw.halt()
	expectRefusal(t, w, w.startRelayNoWait(), "run --on-slot-lost stop")

	relay := w.startRelayNoWait("--existing-rows", "pending")
	back := waitRecovered(t, relay, 0, lostAt)
	writeOnAfterRecovery(t, pw)
	checkRecovered(t, w, relay, "at-least-once", back)
	if !strings.Contains(relay.Output(), `"whole_table":true`) {
		t.Errorf("--existing-rows pending did not compare the whole table:\n%s", harness.LastLines(relay.Output(), 10))
	}
}

// Issue 51.1: `migrate`, which the docs say to run at every deploy, made
// a new slot over a lost one's gap, and the relay then saw no loss: 3,000
// of 5,000 events missing, with the progress record intact. migrate now
// leaves a lost slot to the relay, which recovers it.
func TestDrillMigrateLeavesALostSlotToTheRelay(t *testing.T) {
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	pw, lostAt := loseHistory(t, w, rng, false, recoverFlags...)
	defer pw.halt()
	migrate := harness.StartProcess(t, w.Bin, []string{"migrate", "--pg-dsn", w.DB.DSN(), "--slot", w.Slot}, nil)
	expectRefusal(t, w, migrate, "migrate")

	relay := w.startRelayNoWait(recoverFlags...)
	back := waitRecovered(t, relay, 0, lostAt)
	writeOnAfterRecovery(t, pw)
	checkRecovered(t, w, relay, "at-least-once", back)
}

// Issue 51.1: a first start over rows written before the relay ran looks
// like a lost history; neither is decided silently. The relay refuses;
// --existing-rows pending publishes every row, --existing-rows published
// none of those before the slot, and every start over rows is counted.
func TestFirstStartOverRowsIsAChoice(t *testing.T) {
	for _, choice := range []string{"pending", "published"} {
		t.Run(choice, func(t *testing.T) {
			rng := newRand(t)
			w := newWorld(t, shared, nil)
			k := startKfake(t, harness.KfakeOptions{}, w.topics())
			w.Brokers = k.Brokers()
			w.Migrate("--skip-slot")
			conn := w.connect()
			before := mrand.New(mrand.NewPCG(rng.Uint64(), 2))
			if err := w.writeTxns(conn, before, 30, 5, 20); err != nil {
				t.Fatal(err)
			}
			old, _ := w.Committed()
			expectRefusal(t, w, w.startRelayNoWait(), "a first start over rows")

			// pending loses nothing with the writer running throughout;
			// published gives up what was committed before its slot, so
			// there the writer starts once the slot exists.
			writer := func() *pacedWriter {
				return startPacedWriter(w, w.connect(), mrand.New(mrand.NewPCG(rng.Uint64(), 1)), 10*time.Millisecond, 5, 20, false)
			}
			var pw *pacedWriter
			if choice == "pending" {
				pw = writer()
				defer pw.halt()
			}
			relay := harness.StartProcess(t, w.Bin, w.args("run", "--existing-rows", choice, "--admin-addr", "127.0.0.1:0"), []string{harness.LogLevelInfo})
			relay.WaitForOutput(t, harness.LogStreaming, 2*time.Minute)
			if pw == nil {
				pw = writer()
				defer pw.halt()
			}
			if got := harness.Metric(t, relay.AdminURL(t), "outbox_relay_slots_created_total", "existing_rows", choice); got != 1 {
				t.Errorf("outbox_relay_slots_created_total{existing_rows=%q} = %v, want 1", choice, got)
			}
			start := pw.events.Load()
			harness.WaitFor(t, time.Minute, "200 events committed on the new slot", func() bool { return pw.events.Load() >= start+200 })
			if err := pw.halt(); err != nil {
				t.Fatal(err)
			}
			if choice == "published" {
				// The operator said Kafka holds them: they are not sent.
				w.Forget(old)
			}
			records := w.waitSettled(2 * time.Minute)
			w.checkDelivery(records)
			if choice == "published" {
				skipped := map[string]bool{}
				for _, id := range old {
					skipped[id] = true
				}
				for _, r := range records {
					if skipped[r.EventID()] {
						t.Fatalf("--existing-rows published, yet event %s from before the slot was published", r.EventID())
					}
				}
			}
			t.Logf("--existing-rows %s: %d rows before the slot, %d events checked, %d records", choice, len(old), w.CommittedCount(), len(records))
		})
	}
}

// Issue 51.5: a recovery under --on-permanent-error halt whose gap holds
// an event Kafka refuses for good (an invalid topic name) dropped its
// slot, made a new one, republished, failed and began again every 5-6 s,
// for ever. Halt halts: exit 1, naming the event.
func TestDrillRecoverHaltsOnARefusedGapEvent(t *testing.T) {
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	flags := append([]string{"--on-permanent-error", "halt"}, recoverFlags...)
	publishThenDropSlot(t, w, w.connect(), rng, flags...)
	const bad = "0b5c9d3e-0000-4000-8000-00000000bad1"
	w.DB.Exec(t, "INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'no/such topic', '1', 'Refused', '{}')", bad)

	p := w.startRelayNoWait(flags...)
	code, err := p.Wait(2 * time.Minute)
	if err != nil {
		p.Kill()
		t.Fatalf("--on-permanent-error halt kept recovering a gap with an event Kafka refuses: %v; recoveries begun: %d\n%s",
			err, strings.Count(p.Output(), msgRecovering), harness.LastLines(p.Output(), 20))
	}
	if out := p.Output(); code != 1 || !strings.Contains(out, bad) || !strings.Contains(out, "halt") {
		t.Errorf("halt on a refused gap event: exit %d, want 1 naming event %s:\n%s", code, bad, harness.LastLines(out, 20))
	}
	if n := strings.Count(p.Output(), msgRecovering); n != 1 {
		t.Errorf("%d recoveries begun, want 1", n)
	}
	t.Logf("halted with exit %d: %s", code, lastLogMessage(p.Output()))
}

// Issue 51.9: a progress record that does not decode stopped the relay
// without naming --reset-progress, the one way past it. It must name it,
// and following it must stream with nothing lost.
func TestUnusableProgressRecordNamesResetProgress(t *testing.T) {
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	conn := w.connect()
	relay := w.startRelay()
	if err := w.writeTxns(conn, rng, 10, 5, 20); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute)
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("relay exited %d (%v) on SIGTERM, want 0", code, err)
	}
	sysID := w.DB.QueryString(t, "SELECT system_identifier::text FROM pg_control_system()")
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.Brokers...), kgo.DefaultProduceTopic(progressTopic))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, &kgo.Record{Key: []byte(w.Slot + "@" + sysID), Value: []byte("{not json")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if err := w.writeTxns(conn, rng, 10, 5, 20); err != nil {
		t.Fatal(err)
	}

	p := w.startRelayNoWait()
	code, err := p.Wait(2 * time.Minute)
	if err != nil {
		p.Kill()
		t.Fatalf("the relay went on with a progress record it cannot read: %v\n%s", err, harness.LastLines(p.Output(), 10))
	}
	if out := p.Output(); code != 1 || !strings.Contains(out, "unusable progress record") || !strings.Contains(out, "--reset-progress") {
		t.Fatalf("an unusable progress record: exit %d, want 1 naming --reset-progress:\n%s", code, harness.LastLines(out, 10))
	}
	t.Logf("refused with exit %d: %s", code, lastLogMessage(p.Output()))
	w.startRelay("--reset-progress")
	w.checkDelivery(w.waitSettled(time.Minute))
}

// Issue 51's hostile review: a process started once with --existing-rows
// published, whose slot was dropped under it minutes later, made a new slot
// over the gap and streamed on (196 of 2,358 events lost). The choice is
// for the start it is given to: a slot lost under a running relay is a new
// loss, which --on-slot-lost (stop, here) decides.
func TestExistingRowsIsForOneStart(t *testing.T) {
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	relay := w.startRelay("--existing-rows", "published")
	pw := startPacedWriter(w, w.connect(), mrand.New(mrand.NewPCG(rng.Uint64(), 1)), 10*time.Millisecond, 5, 50, false)
	defer pw.halt()
	harness.WaitFor(t, time.Minute, "200 events committed", func() bool { return pw.events.Load() >= 200 })
	dropSlotUnder(t, w)
	expectRefusal(t, w, relay, "a relay started with --existing-rows published, its slot dropped later")
}

// Issue 51's hostile review: a record of the slot changed to say it was
// made in the future made --on-slot-lost recover compare an empty window
// and report the recovery done (868 events lost). Such a record says
// nothing of where the gap starts: the relay refuses, and its advice,
// followed with the writer running, loses nothing.
func TestDrillRecoverRefusesARecordFromTheFuture(t *testing.T) {
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	pw, lostAt := loseHistory(t, w, rng, true, recoverFlags...)
	defer pw.halt()
	w.DB.Exec(t, "UPDATE outbox_relay_slots SET created_at = now() + interval '2 hours' WHERE slot_name = $1", w.Slot)
	p := w.startRelayNoWait(recoverFlags...)
	code, err := p.Wait(2 * time.Minute)
	if err != nil {
		p.Kill()
		t.Fatalf("the relay went on from a record made in the future: %v\n%s", err, harness.LastLines(p.Output(), 10))
	}
	if out := p.Output(); code != 1 || !strings.Contains(out, "in the future") || !strings.Contains(out, adviceExisting) || strings.Contains(out, msgRecovered) {
		t.Fatalf("a record from the future: exit %d, want 1 naming it and the choices, with no recovery:\n%s", code, harness.LastLines(out, 10))
	}
	relay := w.startRelayNoWait(append(recoverFlags, "--existing-rows", "pending")...)
	back := waitRecovered(t, relay, 0, lostAt)
	writeOnAfterRecovery(t, pw)
	checkRecovered(t, w, relay, "at-least-once", back)
}
