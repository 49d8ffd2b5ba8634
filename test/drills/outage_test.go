package drills

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// pacedWriter commits one small transaction of outbox events (and, with
// otherTable, a row of another table) every interval until stopped. The
// ticker shapes the load; it synchronises nothing.
type pacedWriter struct {
	stop   chan struct{}
	wait   func() error
	events atomic.Int64
	// doubt is the transaction whose commit failed, set before wait
	// returns: after a server crash it may have committed.
	doubt inDoubt
}

// inDoubt is a transaction whose COMMIT got no answer, as when the server
// crashed: it may or may not have committed.
type inDoubt struct {
	ids    []string
	events []harness.OutboxEvent
}

// settle looks the transaction up once the server is back and records it
// in the ledger, after every other, if it committed.
func (d inDoubt) settle(t *testing.T, w *world) {
	t.Helper()
	if len(d.ids) == 0 {
		return
	}
	switch n := w.DB.QueryInt64(t, "SELECT count(*) FROM "+w.Table()+" WHERE event_id = ANY($1::uuid[])", d.ids); n {
	case int64(len(d.ids)):
		w.Record(d.ids, d.events)
	case 0:
	default:
		t.Fatalf("%d of the %d rows of the in-doubt transaction exist: a transaction is atomic", n, len(d.ids))
	}
}

func startPacedWriter(w *world, conn *pgx.Conn, rng *mrand.Rand, every time.Duration, perTxn, aggregates int, otherTable bool) *pacedWriter {
	pw := &pacedWriter{stop: make(chan struct{})}
	pw.wait = runWriter(func() error {
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-pw.stop:
				return nil
			case <-tick.C:
			}
			events := w.genEvents(rng, perTxn, aggregates)
			ids := make([]string, len(events))
			for i := range ids {
				ids[i] = harness.NewUUID()
			}
			if err := w.CommitIDs(context.Background(), conn, ids, events); err != nil {
				pw.doubt = inDoubt{ids: ids, events: events}
				return err
			}
			pw.events.Add(int64(perTxn))
			if otherTable {
				if _, err := conn.Exec(context.Background(), "INSERT INTO other (v) SELECT repeat('o', 2000) FROM generate_series(1, 5)"); err != nil {
					return err
				}
			}
		}
	})
	return pw
}

// halt stops the writer and returns its error.
func (pw *pacedWriter) halt() error {
	select {
	case <-pw.stop:
	default:
		close(pw.stop)
	}
	return pw.wait()
}

// hold keeps a fault in place for d (the deliberate outage), checking check
// every 200ms meanwhile; it stops at the first failed check and returns its
// error.
func hold(d time.Duration, check func() error) error {
	deadline := time.Now().Add(d)
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		if err := check(); err != nil {
			return err
		}
		if !time.Now().Before(deadline) {
			return nil
		}
		<-tick.C
	}
}

// TestDrillBrokerOutage takes Kafka away for longer than
// wal_sender_timeout (10s on a dedicated cluster) while events keep being
// committed. The slot's flush position must stay frozen before the first
// event of the outage; the relay must keep its replication connection
// alive (status updates while the producer retries) or reconnect cleanly,
// never exit; and when the broker returns the backlog must drain with no
// loss and order held. Against Apache Kafka the single broker is stopped
// and restarted on its data, which is where sarama's reconnect bugs live
// (#1430 idempotence broken on reconnect, #1661 skipped sequence numbers
// while a broker was down, #2611 OutOfOrderSequenceNumber after a
// reconnect). kfake cannot be stopped and restarted on the same port with
// its data, so its variant answers every produce request with
// NOT_LEADER_OR_FOLLOWER for the outage instead: the same silence from the
// producer's point of view, without the reconnect.
func TestDrillBrokerOutage(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "10s"}})
	const outage = 15 * time.Second // > wal_sender_timeout

	t.Run("ApacheKafka", func(t *testing.T) {
		k := dedicatedKafka(t, harness.ApacheKafkaOptions{Version: harness.ApacheKafka4Version, Nodes: 1})
		w := newWorld(t, pg, k.Brokers())
		for _, topic := range w.topics() {
			if err := k.CreateTopic(topic, partitions, 1, nil); err != nil {
				t.Fatal(err)
			}
		}
		outageDrill(t, w, outage,
			func() { k.StopNode(0) },
			func() {
				if err := k.StartNode(0); err != nil {
					t.Fatalf("restart broker: %v", err)
				}
			})
	})
	t.Run("kfake", func(t *testing.T) {
		w := newWorld(t, pg, nil)
		k := startKfake(t, harness.KfakeOptions{}, w.topics())
		w.Brokers = k.Brokers()
		var f *harness.ProduceFault
		outageDrill(t, w, outage,
			func() { f = k.FailProduce(-1, kerr.NotLeaderForPartition.Code) },
			func() { f.Remove() })
	})
}

func outageDrill(t *testing.T, w *world, outage time.Duration, down, up func()) {
	rng := newRand(t)
	w.Migrate()
	conn := w.connect()
	relay := w.startRelay()
	if err := w.writeTxns(conn, rng, 20, 5, 100); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute)
	pid := w.walsenderPID()

	down()
	fence := w.fence(conn, w.genEvents(rng, 5, 100))
	pw := startPacedWriter(w, conn, writerRand(rng), 50*time.Millisecond, 5, 100, false)
	pids := map[int]bool{pid: true}
	// Keep the broker away for the whole outage: a deliberate fault
	// duration, checked throughout, not a wait for anything.
	err := hold(outage, func() error {
		if c := w.ConfirmedFlush(); !notPast(c, fence) {
			return fmt.Errorf("confirmed_flush_lsn %s passed the first event of the outage (commit at %s)", c, fence)
		}
		if relay.Exited() {
			return fmt.Errorf("relay exited during the outage:\n%s", relay.Output())
		}
		if p := w.walsenderPID(); p != 0 {
			pids[p] = true
		}
		return nil
	})
	if werr := pw.halt(); werr != nil {
		t.Fatal(werr)
	}
	if err != nil {
		up()
		t.Fatal(err)
	}
	if c := w.ConfirmedFlush(); !notPast(c, fence) {
		t.Fatalf("confirmed_flush_lsn %s passed the first event of the outage (commit at %s)", c, fence)
	}
	restarts := strings.Count(relay.Output(), msgRestart)
	t.Logf("outage of %v with %d events committed meanwhile; walsender pids seen %v, %d stream restarts %q",
		outage, pw.events.Load()+5, keys(pids), restarts, restartReasons(relay.Output()))

	back := time.Now()
	up()
	w.consumeAll(3 * time.Minute)
	drained := time.Since(back)
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	after := w.walsenderPID()
	if after == 0 {
		t.Errorf("no walsender streams the slot after the broker came back")
	}
	pids[after] = true
	if len(pids) > 1 && strings.Count(relay.Output(), msgRestart) == 0 {
		t.Errorf("the replication connection changed (walsender pids %v) without the relay logging a restart: it was dropped, not reconnected cleanly", keys(pids))
	}
	t.Logf("backlog drained %v after the broker returned; %d records for %d events (%d duplicates); walsender pid %s",
		drained.Round(time.Millisecond), len(records), w.CommittedCount(), len(records)-w.CommittedCount(),
		map[bool]string{true: "unchanged", false: fmt.Sprintf("changed %v", keys(pids))}[len(pids) == 1])
}

func keys(m map[int]bool) []int {
	out := make([]int, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestDrillBackpressureVsSenderTimeout holds every produce request for 15s,
// three times wal_sender_timeout (5s on a dedicated cluster), while outbox
// events and other tables' writes keep coming. The relay stops reading WAL
// at its in-flight bound but must keep answering the walsender: if it goes
// silent, PostgreSQL drops it for timeout and it restarts (the pid in
// pg_stat_replication changes). And no keepalive may confirm WAL past the
// held events (the idle-confirm rule: never while acks are pending).
func TestDrillBackpressureVsSenderTimeout(t *testing.T) {
	const held = 15 * time.Second
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "5s"}})
	w, k := newKfakeWorld(t, pg)
	w.DB.Exec(t, "CREATE TABLE other (id bigserial PRIMARY KEY, v text)")
	conn := w.connect()
	relay := w.startRelay("--max-in-flight-events", "500")
	if err := w.writeTxns(conn, rng, 20, 5, 100); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute) // every topic known before the hold
	pid := w.walsenderPID()
	if pid == 0 {
		t.Fatal("no walsender streams the slot")
	}

	release := k.HoldProduce()
	defer release()
	fence := w.fence(conn, w.genEvents(rng, 5, 100))
	pw := startPacedWriter(w, conn, writerRand(rng), 20*time.Millisecond, 5, 100, true)
	maxHeld := 0
	lowest := ""
	// Keep produce held for the whole period: a deliberate fault duration,
	// checked throughout, not a wait for anything.
	err := hold(held, func() error {
		c := w.ConfirmedFlush()
		if !notPast(c, fence) {
			return fmt.Errorf("confirmed_flush_lsn %s passed the held events (first commit at %s)", c, fence)
		}
		lowest = c
		if p := w.walsenderPID(); p != pid {
			return fmt.Errorf("walsender pid changed from %d to %d during the hold: the server dropped the relay's replication connection", pid, p)
		}
		if relay.Exited() || strings.Contains(relay.Output(), msgRestart) {
			return fmt.Errorf("relay restarted or exited during the hold:\n%s", relay.Output())
		}
		maxHeld = max(maxHeld, k.HeldProduces())
		return nil
	})
	if werr := pw.halt(); werr != nil {
		t.Fatal(werr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if maxHeld == 0 {
		t.Fatal("no produce request was ever held: the drill did not exercise backpressure")
	}
	t.Logf("held produce for %v (up to %d requests parked) with %d events committed meanwhile; slot stayed at %s, fence %s",
		held, maxHeld, pw.events.Load()+5, lowest, fence)

	released := time.Now()
	release()
	w.consumeAll(3 * time.Minute)
	arrived := time.Since(released)
	records := w.waitSettled(3 * time.Minute)
	t.Logf("everything arrived %v after the release (slot confirmed all %v after it); %d records for %d events",
		arrived.Round(time.Millisecond), time.Since(released).Round(time.Millisecond), len(records), w.CommittedCount())
	w.checkDelivery(records)
	if p := w.walsenderPID(); p != pid {
		t.Errorf("walsender pid changed from %d to %d", pid, p)
	}
	if n := strings.Count(relay.Output(), msgRestart); n > 0 {
		t.Errorf("relay restarted its stream %d times", n)
	}
}
