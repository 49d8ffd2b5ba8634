package drills

import (
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillKafkaUnreachableKeepsReplication makes the only broker
// unreachable (its connections cut, new ones closed at once) for longer
// than wal_sender_timeout while events keep being committed. sarama then
// reports the records in flight as failed, and cannot reconnect. The relay
// must keep its replication connection through the outage (the same
// walsender pid), let oldest_unpublished_event_age_seconds grow so the age
// alert can fire, and deliver everything once the broker is back (it then
// re-streams on a new connection). It pins the issue where the session
// ended at once and the relay sat in "connecting" with the age at 0.
func TestDrillKafkaUnreachableKeepsReplication(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "10s"}})
	const outage = 15 * time.Second // > wal_sender_timeout
	w := newWorld(t, pg, nil)
	gate := &gatedListeners{}
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, w.topics()...), kfake.ListenFn(gate.listen))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	w.Brokers = cluster.ListenAddrs()

	rng := newRand(t)
	w.Migrate()
	conn := w.connect()
	admin := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	relay := w.startRelay("--admin-addr", admin)
	if err := w.writeTxns(conn, rng, 20, 5, 100); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute)
	pid := w.walsenderPID()

	gate.down()
	fence := w.fence(conn, w.genEvents(rng, 5, 100))
	pw := startPacedWriter(w, conn, writerRand(rng), 100*time.Millisecond, 5, 100, false)
	var maxAge float64
	err = hold(outage, func() error {
		if relay.Exited() {
			return fmt.Errorf("relay exited during the outage:\n%s", relay.Output())
		}
		if c := w.ConfirmedFlush(); !notPast(c, fence) {
			return fmt.Errorf("confirmed_flush_lsn %s passed the first event of the outage (commit at %s)", c, fence)
		}
		if p := w.walsenderPID(); p != pid {
			return fmt.Errorf("walsender pid changed from %d to %d during the outage: the replication connection was dropped", pid, p)
		}
		if v, ok := harness.MetricValue(harness.Scrape(t, "http://"+admin), "outbox_relay_oldest_unpublished_event_age_seconds"); ok {
			maxAge = max(maxAge, v)
		}
		return nil
	})
	if werr := pw.halt(); werr != nil {
		t.Fatal(werr)
	}
	gate.up()
	if err != nil {
		t.Fatal(err)
	}
	if maxAge < 5 {
		t.Errorf("oldest_unpublished_event_age_seconds peaked at %v during a %v outage, want it to grow", maxAge, outage)
	}

	w.consumeAll(3 * time.Minute)
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	t.Logf("outage %v: %d events committed meanwhile, oldest unpublished age peaked at %.1fs, walsender pid %d throughout the outage (%d after it), %d records for %d events",
		outage, pw.events.Load()+5, maxAge, pid, w.walsenderPID(), len(records), w.CommittedCount())
}

// gatedListeners wrap kfake's listeners so a test can make the brokers
// unreachable: down cuts every connection and closes new ones at once.
type gatedListeners struct {
	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]bool
}

func (g *gatedListeners) listen(network, address string) (net.Listener, error) {
	ln, err := net.Listen(network, address)
	if err != nil {
		return nil, err
	}
	return &gatedListener{Listener: ln, gate: g}, nil
}

func (g *gatedListeners) down() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = true
	for c := range g.conns {
		c.Close()
	}
	g.conns = nil
}

func (g *gatedListeners) up() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = false
}

type gatedListener struct {
	net.Listener
	gate *gatedListeners
}

func (l *gatedListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		g := l.gate
		g.mu.Lock()
		if g.closed {
			g.mu.Unlock()
			c.Close()
			continue
		}
		if g.conns == nil {
			g.conns = map[net.Conn]bool{}
		}
		g.conns[c] = true
		g.mu.Unlock()
		return c, nil
	}
}
