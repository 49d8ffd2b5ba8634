package drills

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// eosFlags run the relay in exactly-once mode with a short transaction
// interval, so the drills see many Kafka transactions.
var eosFlags = []string{"--delivery", "exactly-once", "--transaction-interval", "50ms"}

// settleExactlyOnce commits one source transaction with an event on every
// partition of every drill topic, waits until the slot confirmed it, and
// reads with read_committed until every committed event is visible. The
// relay confirms only after the Kafka transaction committed, and that
// transaction holds the last records of every partition, so once a reader
// saw it on each partition it read everything visible before it: then
// every event must be there exactly once, and nothing else.
func (w *world) settleExactlyOnce(timeout time.Duration) []harness.Record {
	w.T.Helper()
	conn := w.connect()
	var markers []harness.OutboxEvent
	for _, typ := range w.types {
		covered := map[int32]bool{}
		for i := 0; len(covered) < partitions; i++ {
			id := fmt.Sprintf("settle-%s-%d", typ, i)
			if p := harness.JavaPartition([]byte(id), partitions); !covered[p] {
				covered[p] = true
				markers = append(markers, harness.OutboxEvent{AggregateType: typ, AggregateID: id, EventType: "Settled", Payload: `{"marker": true}`})
			}
		}
	}
	commit := w.fence(conn, markers)
	harness.WaitFor(w.T, timeout, "the slot confirms the settle transaction (commit at "+commit+")", func() bool {
		return !notPast(w.ConfirmedFlush(), commit)
	})
	ids, order := w.Committed()
	records := harness.ConsumeExactlyOnce(w.T, w.Brokers, w.topicRegex(), ids, timeout)
	harness.CheckPerAggregateOrder(w.T, records, order)
	return records
}

// checkTxnsCommitted fails unless the relay's log shows Kafka transactions
// committed: a drill passing in at-least-once mode proves nothing here.
func checkTxnsCommitted(t *testing.T, out string) {
	t.Helper()
	if !strings.Contains(out, "exactly-once producer initialised") {
		t.Fatalf("the relay never initialised a transactional producer:\n%s", out)
	}
}

// TestDrillEOSCrashes SIGKILLs an exactly-once relay at random moments
// while a writer commits multi-event transactions, restarting it each
// time. Every life resumes from the progress record committed with its
// last Kafka transaction, so read_committed readers must see every event
// exactly once (risks: resuming from the slot behind the progress, a
// progress record outside its transaction, confirming before the commit,
// a fenced zombie committing after the new life read the progress).
//
// Reduced: 5 kills; OUTBOX_RELAY_DRILL_SIZE=full: 20 kills.
func TestDrillEOSCrashes(t *testing.T) {
	kills := harness.Sized(5, 20)
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	off := newOffsets(t, w.Brokers)
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 5*time.Millisecond, 7, 300, false)
	defer pw.halt()

	relay := w.startRelayNoWait(eosFlags...)
	for i := range kills {
		// A random share of a life: right at start-up (one in five), or
		// after up to 2,000 more records reached Kafka, committed or not.
		target := int64(rng.IntN(2000))
		if rng.IntN(5) == 0 {
			target = 0
		}
		relay = w.killAfter(relay, off, i+1, target, eosFlags)
	}
	if err := pw.halt(); err != nil {
		t.Fatalf("writer: %v", err)
	}
	relay.WaitForOutput(t, harness.LogStreaming, 2*time.Minute)
	checkTxnsCommitted(t, relay.Output())
	records := w.settleExactlyOnce(3 * time.Minute)
	checkWithKcat(t, w, records) // a second, independent read_committed reader
	t.Logf("EOS crashes: %d kills, %d events, %d records visible to read_committed (0 duplicates, 0 missing)",
		kills, w.CommittedCount(), len(records))
}

// TestDrillEOSPostgresImmediateRestart crashes PostgreSQL under an
// exactly-once relay and a live writer: the relay re-streams from the
// progress record and readers see each event once.
func TestDrillEOSPostgresImmediateRestart(t *testing.T) {
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{})
	w, _ := newKfakeWorld(t, pg)
	off := newOffsets(t, w.Brokers)
	relay := w.startRelay(eosFlags...)
	checkTxnsCommitted(t, relay.Output())
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 5*time.Millisecond, 7, 300, false)
	harness.WaitFor(t, 2*time.Minute, "the relay streams a busy outbox", func() bool {
		m, err := off.read(w.topics())
		return err == nil && sumOffsets(m) >= 2000
	})
	streams := strings.Count(relay.Output(), harness.LogStreaming)
	pg.StopImmediate(t)
	// The writer stops on the crash; the transaction whose commit got no
	// answer is not in the ledger, and is looked up below.
	werr := pw.halt()
	t.Logf("PostgreSQL crashed with %d events committed (writer stopped on: %v)", w.CommittedCount(), werr)
	pg.Start(t)
	harness.WaitFor(t, 2*time.Minute, "the relay streams again", func() bool {
		return relay.Exited() || strings.Count(relay.Output(), harness.LogStreaming) > streams
	})
	if relay.Exited() {
		t.Fatalf("relay exited after the PostgreSQL crash:\n%s", relay.Output())
	}
	// The restart line must not tell an operator of this mode to expect
	// duplicates.
	if !strings.Contains(relay.Output(), msgRestart) || !strings.Contains(relay.Output(), "read_committed consumers see each once") {
		t.Errorf("no restart line saying read_committed consumers see each event once:\n%s", harness.LastLines(relay.Output(), 30))
	}
	pw.doubt.settle(t, w)
	if n := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events"); n != int64(w.CommittedCount()) {
		t.Fatalf("table holds %d events, the writer knows of %d", n, w.CommittedCount())
	}
	conn2 := w.connect()
	if err := w.writeTxns(conn2, rng, 50, 7, 300); err != nil {
		t.Fatal(err)
	}
	records := w.settleExactlyOnce(3 * time.Minute)
	t.Logf("%d events, %d records visible to read_committed", w.CommittedCount(), len(records))
}

// TestDrillEOSBrokerOutage refuses every produce request for longer than
// a Kafka transaction may wait, under a writer: the open transaction
// aborts, the relay re-streams from the progress once Kafka is back, and
// the aborted records stay invisible to read_committed.
func TestDrillEOSBrokerOutage(t *testing.T) {
	rng := newRand(t)
	w := newWorld(t, shared, nil)
	k := startKfake(t, harness.KfakeOptions{}, w.topics())
	w.Brokers = k.Brokers()
	w.Migrate()
	relay := w.startRelay(eosFlags...)
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 20*time.Millisecond, 5, 100, false)
	harness.WaitFor(t, time.Minute, "Kafka transactions commit", func() bool {
		return sumOffsets(endOffsets(t, w.Brokers, w.topics())) > 0
	})
	f := k.FailProduce(-1, kerr.NotLeaderForPartition.Code)
	// The outage lasts until the open Kafka transaction failed: its
	// records are retried for up to the 20 s a Kafka transaction may stay
	// open, and on a loaded machine the retries take longer than that, so
	// a fixed outage could end before anything failed.
	const failed = "kafka failed; keeping the replication connection"
	err := hold(2*time.Minute, func() error {
		if relay.Exited() {
			return fmt.Errorf("relay exited during the outage:\n%s", relay.Output())
		}
		if strings.Contains(relay.Output(), failed) {
			return errOutageServed
		}
		return nil
	})
	switch {
	case errors.Is(err, errOutageServed):
		err = nil
	case err == nil:
		err = fmt.Errorf("no Kafka transaction failed within 2 minutes of refused produce requests:\n%s", relay.Output())
	}
	f.Remove()
	if werr := pw.halt(); werr != nil {
		t.Fatal(werr)
	}
	if err != nil {
		t.Fatal(err)
	}
	records := w.settleExactlyOnce(3 * time.Minute)
	restarts := strings.Count(relay.Output(), failed)
	t.Logf("outage: %d events, %d records visible to read_committed, %d waits for Kafka", w.CommittedCount(), len(records), restarts)
	if restarts == 0 {
		t.Errorf("no Kafka transaction failed during the outage: the drill did not test an abort\n%s", relay.Output())
	}
}

// errOutageServed ends an outage once it did what the drill needs.
var errOutageServed = errors.New("the outage made a Kafka transaction fail")

// TestDrillEOSPoisonInMultiEventTxn: the broker refuses one event of a
// five-event PostgreSQL transaction, amid others, inside the relay's Kafka
// transaction. The transaction aborts, the relay re-streams, finds the
// poison by sending suspects alone, and quarantines it: the four other
// events of its transaction and everything around it become visible once,
// the poison never, and it is quarantined exactly once.
func TestDrillEOSPoisonInMultiEventTxn(t *testing.T) {
	rng := newRand(t)
	w, k := newKfakeWorld(t, shared)
	relay := w.startRelay(append([]string{"--compression", "none"}, eosFlags...)...) // the refusal finds the poison by its bytes
	conn := w.connect()
	if err := w.writeTxns(conn, rng, 30, 5, 50); err != nil {
		t.Fatal(err)
	}
	events := w.genEvents(rng, 5, 50)
	ids := make([]string, len(events))
	for i := range ids {
		ids[i] = harness.NewUUID()
	}
	poison := ids[2]
	refusal := k.RefuseRecordsWith([]byte(poison), kerr.InvalidRecord.Code)
	defer refusal.Remove()
	if err := w.CommitIDs(context.Background(), conn, ids, events); err != nil {
		t.Fatal(err)
	}
	w.Forget([]string{poison}) // never to be visible
	if err := w.writeTxns(conn, rng, 30, 5, 50); err != nil {
		t.Fatal(err)
	}
	w.settleExactlyOnce(3 * time.Minute)
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	if n := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE event_id = $1::uuid", poison); n != 1 {
		t.Fatalf("poison event in the quarantine table %d times, want 1", n)
	}
	if n := countQuarantined(relay.Output(), poison); n != 1 {
		t.Fatalf("the poison event was quarantined %d times, want once:\n%s", n, relay.Output())
	}
	if refusal.Hits() == 0 {
		t.Fatal("the broker never refused the poison: the drill tested nothing")
	}
	t.Logf("poison refused %d times by the broker, quarantined once; %d events visible once", refusal.Hits(), w.CommittedCount())
}

// countQuarantined counts the relay's "event quarantined" lines for id.
func countQuarantined(out, id string) int {
	n := 0
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "event quarantined") && strings.Contains(line, id) {
			n++
		}
	}
	return n
}

// TestDrillEOSZombieFenced freezes the streaming exactly-once relay
// (SIGSTOP) with a Kafka transaction open, lets its walsender time out so
// the standby takes the slot, initialises its producer (fencing the
// frozen one) and streams; then wakes the zombie. The zombie must never
// commit again: it is fenced, or loses its replication connection first,
// and goes back to standby. Every event stays visible exactly once.
func TestDrillEOSZombieFenced(t *testing.T) {
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "2s"}})
	w, _ := newKfakeWorld(t, pg)
	off := newOffsets(t, w.Brokers)
	zombie := w.startRelay(eosFlags...)
	standby := w.startRelayNoWait(eosFlags...)
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 5*time.Millisecond, 5, 200, false)
	defer pw.halt()
	harness.WaitFor(t, time.Minute, "the first relay publishes", func() bool {
		m, err := off.read(w.topics())
		return err == nil && sumOffsets(m) >= 1000
	})
	if err := zombie.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozen := time.Now()
	standby.WaitForOutput(t, harness.LogStreaming, time.Minute)
	t.Logf("standby streaming %v after the freeze", time.Since(frozen).Round(time.Millisecond))
	before, err := off.read(w.topics())
	if err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, time.Minute, "the new relay publishes", func() bool {
		m, err := off.read(w.topics())
		return err == nil && sumOffsets(m) >= sumOffsets(before)+500
	})
	if err := zombie.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	const fenced, standingBy = "fenced by another relay", "waiting to take over"
	harness.WaitFor(t, time.Minute, "the woken relay gives up the stream", func() bool {
		out := zombie.Output()
		return zombie.Exited() || strings.Contains(out, fenced) || strings.Contains(out, standingBy)
	})
	if err := pw.halt(); err != nil {
		t.Fatalf("writer: %v", err)
	}
	records := w.settleExactlyOnce(3 * time.Minute)
	checkWithKcat(t, w, records)
	if zombie.Exited() || standby.Exited() {
		t.Fatalf("a relay exited:\nzombie:\n%s\nstandby:\n%s", zombie.Output(), standby.Output())
	}
	for _, line := range strings.Split(zombie.Output(), "\n") {
		if strings.Contains(line, fenced) {
			t.Logf("the zombie on waking: %.600s", line)
			break
		}
	}
	t.Logf("zombie fenced: %v; %d events, %d records visible once", strings.Contains(zombie.Output(), fenced), w.CommittedCount(), len(records))
}

// TestDrillEOSLeaderFailover SIGKILLs the leader of a partition an
// exactly-once relay writes to, on three Apache Kafka brokers (replication
// factor 3, min.insync.replicas=2), under a writer: the transaction
// coordinator may be the same node, so a Kafka transaction may abort or be
// retried; read_committed readers must still see every event exactly once.
func TestDrillEOSLeaderFailover(t *testing.T) {
	eosNodeFailover(t, "drill_failover_eos.", "leader of partition 0 of the first topic", nil,
		func(w *world, k *harness.ApacheKafka) (int, error) { return k.PartitionLeader(w.topics()[0], 0) })
}

// TestDrillEOSCoordinatorFailover SIGKILLs the node coordinating the
// relay's Kafka transactions, under a writer, with a transaction begun
// every 50 ms: a transaction is always open at the kill and sometimes
// inside its commit (EndTxn). The coordinator's state moves to another
// node, which completes or aborts what was open; the relay must find it,
// and read_committed readers must see every event exactly once.
func TestDrillEOSCoordinatorFailover(t *testing.T) {
	id := fmt.Sprintf("drill-coordinator-%d", time.Now().UnixNano())
	eosNodeFailover(t, "drill_coordinator_eos.", "coordinator of "+id, []string{"--transactional-id", id},
		func(_ *world, k *harness.ApacheKafka) (int, error) { return k.TransactionCoordinator(id) })
}

// eosNodeFailover runs an exactly-once relay on three Apache Kafka brokers
// (replication factor 3, min.insync.replicas=2), SIGKILLs the node that
// victim names once a writer is under way, checks that every event is
// visible once to read_committed, then restarts the node and checks again.
func eosNodeFailover(t *testing.T, prefix, role string, flags []string, victim func(*world, *harness.ApacheKafka) (int, error)) {
	rng := newRand(t)
	w, k := newFailoverWorld(t, prefix)
	conn := w.connect()
	relay := w.startRelay(append(slices.Clone(eosFlags), flags...)...)
	checkTxnsCommitted(t, relay.Output())
	wrng := writerRand(rng)
	wait := runWriter(func() error { return w.writeTxns(conn, wrng, 600, 10, 300) })
	harness.WaitFor(t, time.Minute, "the writer is under way", func() bool { return w.CommittedCount() > 1500 })
	node, err := victim(w, k)
	if err != nil {
		t.Fatal(err)
	}
	restart := killNode(t, k, node)
	killed, atKill := time.Now(), w.CommittedCount()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	w.settleExactlyOnce(3 * time.Minute)
	t.Logf("killed node %d, %s, with %d events committed; all %d visible once %v after the kill",
		node, role, atKill, w.CommittedCount(), time.Since(killed).Round(time.Millisecond))
	restart()
	if err := w.writeTxns(conn, rng, 50, 10, 300); err != nil {
		t.Fatal(err)
	}
	records := w.settleExactlyOnce(3 * time.Minute)
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	t.Logf("%d events, %d records visible to read_committed, %d stream restarts", w.CommittedCount(), len(records),
		strings.Count(relay.Output(), msgRestart))
}

// TestDrillEOSAllOrNothing holds the relay's commit (EndTxn) of a Kafka
// transaction carrying one PostgreSQL transaction of events on many
// partitions of three topics: while it is held, the records are in the
// log, yet no read_committed reader can read any of them and the slot is
// not confirmed past the transaction; once released, all become visible
// together, once.
func TestDrillEOSAllOrNothing(t *testing.T) {
	rng := newRand(t)
	w, k := newKfakeWorld(t, shared)
	w.startRelay(eosFlags...)
	conn := w.connect()
	if err := w.writeTxns(conn, rng, 20, 5, 100); err != nil {
		t.Fatal(err)
	}
	w.settleExactlyOnce(time.Minute)
	stable := func() (n int64) {
		for _, topic := range w.topics() {
			n += sumOffsets(harness.StableOffsets(t, w.Brokers, topic))
		}
		return n
	}
	ends := func() int64 { return sumOffsets(endOffsets(t, w.Brokers, w.topics())) }
	lsoBefore, hwmBefore := stable(), ends()

	release := k.HoldRequests(kmsg.EndTxn)
	defer release()
	events := w.genEvents(rng, 30, 100)
	commit := w.fence(conn, events)
	harness.WaitFor(t, time.Minute, "the Kafka transaction's commit reaches the coordinator", func() bool {
		return k.HeldRequests() > 0 && ends() >= hwmBefore+int64(len(events))
	})
	if lso := stable(); lso != lsoBefore {
		t.Fatalf("last stable offsets moved from %d to %d before the commit: read_committed readers can read part of the transaction", lsoBefore, lso)
	}
	if c := w.ConfirmedFlush(); !notPast(c, commit) {
		t.Fatalf("slot confirmed %s, past the transaction at %s, before its Kafka transaction committed", c, commit)
	}
	release()
	records := w.settleExactlyOnce(time.Minute)
	t.Logf("%d events of one PostgreSQL transaction held invisible until the commit; %d records visible once", len(events), len(records))
}
