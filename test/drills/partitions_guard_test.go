package drills

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Drills of what partitions adopt and a running relay must refuse or say
// when a topic's partitions change (docs/partitions.md), found by a
// hostile tester.

// snapshotLockSQL takes, on a test's own session, the lock the active
// snapshot poller of the drills' outbox table holds (poll's snapshotLock),
// so a poller started next waits as a standby.
const snapshotLockSQL = `SELECT pg_advisory_lock(hashtext('outbox-relay poll snapshot'), hashtext('"public"."outbox_events"'))`

// TestDrillPartitionsAdoptSeesSnapshotPollers: adopt must refuse while a
// snapshot poller publishes the table, and while a snapshot standby waits
// for its lock (it takes over the moment the active one stops, with the
// count it read). It accepted both before, exit 0, saying to start the
// relay, while the poller kept publishing by the old count.
func TestDrillPartitionsAdoptSeesSnapshotPollers(t *testing.T) {
	w := newWorld(t, shared, nil)
	w.Source = "poll"
	w.Brokers = startKfake(t, harness.KfakeOptions{}, w.topics()).Brokers()
	w.Migrate("--poll-strategy", "snapshot")
	conn := w.connect()
	if err := w.writeTxns(conn, newRand(t), 10, 5, 50); err != nil {
		t.Fatal(err)
	}
	poller := w.startSource("--poll-strategy", "snapshot")
	w.consumeAll(time.Minute)
	group := "any-" + w.Slot
	code, out := harness.RunCommand(t, w.Bin, w.adoptArgs(group))
	if code != 1 || !strings.Contains(out, "a snapshot poller is publishing public.outbox_events") || !strings.Contains(out, "Stop it first") {
		t.Errorf("adopt with a snapshot poller publishing: exit %d, want 1 naming it and what to do:\n%s", code, out)
	}
	if code, err := poller.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("stop the poller: exit %d, %v", code, err)
	}

	// A standby: the lock held elsewhere (here by this test's session, as
	// by an active poller), the poller waits for it.
	lock := w.connect()
	if _, err := lock.Exec(context.Background(), snapshotLockSQL); err != nil {
		t.Fatal(err)
	}
	standby := w.startRelayNoWait("--poll-strategy", "snapshot")
	standby.WaitForOutput(t, "waiting as its standby", time.Minute)
	code, out = harness.RunCommand(t, w.Bin, w.adoptArgs(group))
	want := fmt.Sprintf("PostgreSQL session PID %d", w.DB.QueryInt64(t, `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = 1886350444 LIMIT 1`))
	if code != 1 || !strings.Contains(out, "a snapshot standby waiting to take over") || !strings.Contains(out, want) {
		t.Errorf("adopt with a snapshot standby waiting: exit %d, want 1 naming the standby (%s):\n%s", code, want, out)
	}
	standby.Kill()
	if n := w.DB.QueryInt64(t, "SELECT partitions FROM outbox_relay_partitions WHERE topic = $1", w.topics()[0]); n != partitions {
		t.Errorf("a refused adopt recorded %d partitions, want %d unchanged", n, partitions)
	}
}

// TestDrillPartitionsAdoptSeesOtherSlots: two WAL relays on one outbox
// table, each on its own slot, share the table's registry. With relay A
// stopped, adopt --slot A must refuse while relay B streams, naming B's
// slot: B maps keys by the old count until it restarts. It accepted
// before, and B kept publishing by the old count.
func TestDrillPartitionsAdoptSeesOtherSlots(t *testing.T) {
	w, _ := newKfakeWorld(t, shared)
	slotB := w.Slot + "_b"
	t.Cleanup(func() {
		w.DB.Exec(t, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", slotB)
	})
	relayA := w.startRelay()
	relayB := w.startRelay("--slot", slotB)
	conn := w.connect()
	if err := w.writeTxns(conn, newRand(t), 10, 5, 50); err != nil {
		t.Fatal(err)
	}
	w.consumeAll(time.Minute)
	if code, err := relayA.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("stop relay A: exit %d, %v", code, err)
	}
	addPartitions(t, w.Brokers, w.topics(), 2*partitions)
	code, out := harness.RunCommand(t, w.Bin, w.adoptArgs("any-"+w.Slot))
	if code != 1 || !strings.Contains(out, "a relay is streaming replication slot '"+slotB+"'") {
		t.Errorf("adopt --slot %s with a relay on slot %s: exit %d, want 1 naming slot %s:\n%s", w.Slot, slotB, code, slotB, out)
	}
	if code, err := relayB.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("stop relay B: exit %d, %v", code, err)
	}
	if n := w.DB.QueryInt64(t, "SELECT partitions FROM outbox_relay_partitions WHERE topic = $1", w.topics()[0]); n != partitions {
		t.Errorf("a refused adopt recorded %d partitions, want %d unchanged", n, partitions)
	}
}

// TestDrillPartitionsAdoptUnrecordedTopic: adopt of a topic the relay
// never published to has nothing to adopt: exit 1, saying so, and nothing
// recorded (it wrote a row before, which show then listed).
func TestDrillPartitionsAdoptUnrecordedTopic(t *testing.T) {
	w, k := newKfakeWorld(t, shared)
	other := w.topicPrefix + "other"
	k.CreateTopic(t, other, 3, nil)
	code, out := harness.RunCommand(t, w.Bin, w.partitionsArgs("adopt", "--event-topic", other, "--partitions", "3", "--consumer-groups", "any"))
	if code != 1 || !strings.Contains(out, "the relay never published to it") || !strings.Contains(out, "partitions show") {
		t.Errorf("adopt of a topic never published to: exit %d, want 1 saying there is nothing to adopt:\n%s", code, out)
	}
	if n := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_relay_partitions"); n != 0 {
		t.Errorf("the refused adopt wrote %d registry rows", n)
	}
}

// TestDrillPartitionsFewerWhileRunning: an event topic deleted under a
// running relay, while a writer commits at a steady rate, and made again
// with fewer partitions than its keys are mapped by. Meanwhile (the topic
// missing) the relay must wait, quarantining nothing; once the topic is
// back smaller it must stop, exit 1, with the error that says the topic
// was deleted and created again and what to do, and publish nothing to it.
// Before, the lease poller neither stopped nor said so and quarantined an
// event of the gap, and the WAL relay's only error line was a retriable
// one saying it re-streams.
func TestDrillPartitionsFewerWhileRunning(t *testing.T) {
	for _, source := range []string{"wal", "poll"} {
		t.Run(source, func(t *testing.T) {
			w := newWorld(t, shared, nil)
			if source == "poll" {
				w.Source = "poll"
			}
			// Auto-creation off: the deleted topic stays missing until
			// made again.
			w.Brokers = startKfake(t, harness.KfakeOptions{DisableAutoCreate: true}, w.topics()).Brokers()
			w.Migrate()
			pw := startPacedWriter(w, w.connect(), writerRand(newRand(t)), 20*time.Millisecond, 1, 50, false) // 50 events/s
			defer pw.halt()
			relay := w.startSource()
			topic := w.topics()[0]
			harness.WaitFor(t, time.Minute, "the relay publishes to "+topic, func() bool {
				_, n := harness.TopicRecords(t, w.Brokers, topic)
				return n > 0
			})
			harness.DeleteTopic(t, w.Brokers, topic)
			relay.WaitForOutput(t, "does not exist on the brokers, but the relay published to it before", 2*time.Minute)
			harness.CreateTopic(t, w.Brokers, topic, partitions/2, nil)
			code, err := relay.Wait(2 * time.Minute)
			if err != nil {
				t.Fatalf("the relay did not stop on the smaller topic: %v\n%s", err, harness.LastLines(relay.Output(), 20))
			}
			if err := pw.halt(); err != nil {
				t.Fatalf("writer: %v", err)
			}
			out := relay.Output()
			last := harness.LastLines(out, 3)
			for _, s := range []string{fmt.Sprintf("has %d partitions, fewer than the %d", partitions/2, partitions), "it was deleted and created again", "partitions adopt --event-topic " + topic} {
				if !strings.Contains(last, s) {
					t.Errorf("the relay's last lines lack %q:\n%s", s, last)
				}
			}
			if code != 1 {
				t.Errorf("the relay exited %d, want 1", code)
			}
			if _, n := harness.TopicRecords(t, w.Brokers, topic); n != 0 {
				t.Errorf("the relay published %d records to the smaller topic", n)
			}
			if n := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine"); n != 0 {
				t.Errorf("%d events quarantined; a deleted topic's events wait", n)
			}
		})
	}
}
