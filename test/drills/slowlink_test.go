package drills

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// advertised is a broker's listener that names the proxy in front of it:
// kfake tells clients the address its listener reports, so clients come
// back through the proxy after the first metadata answer, as they do to
// an Apache Kafka broker whose advertised.listeners names the proxy.
type advertised struct {
	net.Listener
	addr net.Addr
}

func (a advertised) Addr() net.Addr { return a.addr }

// kfakeBehindToxi starts a one-broker kfake cluster that clients reach only
// through toxiproxy, and returns the proxy.
func kfakeBehindToxi(t *testing.T, topics []string) (*kfake.Cluster, *harness.Toxi) {
	t.Helper()
	var toxi *harness.Toxi
	listen := func(network, address string) (net.Listener, error) {
		ln, err := net.Listen(network, address)
		if err != nil {
			return nil, err
		}
		toxi = harness.StartToxi(t, ln.Addr().String())
		front, err := net.ResolveTCPAddr("tcp", toxi.Addr())
		if err != nil {
			ln.Close()
			return nil, err
		}
		return advertised{Listener: ln, addr: front}, nil
	}
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topics...), kfake.ListenFn(listen))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	return cluster, toxi
}

// TestDrillSlowLinks puts 100 ms ± 50 ms of latency each way and a
// bandwidth cap on both the PostgreSQL and the Kafka link while a writer
// commits about 100 events a second, in both delivery modes. Throughput
// may drop; nothing else may happen: the replication stream is never taken
// for dead (its pings are answered late, not never), no order break, no
// loss, and no duplicates for read_committed readers.
//
// On kfake and on Apache Kafka, whose client listener advertises the proxy.
func TestDrillSlowLinks(t *testing.T) {
	for _, broker := range []string{"kfake", "apache"} {
		for _, mode := range []string{"at-least-once", "exactly-once"} {
			t.Run(broker+"/"+mode, func(t *testing.T) { slowLinks(t, broker, mode) })
		}
	}
}

func slowLinks(t *testing.T, broker, mode string) {
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "10s"}})
	w := newWorld(t, pg, nil)
	var kafkaToxi *harness.Toxi
	var flags []string
	if broker == "apache" {
		w.topicPrefix = "drill_slow_" + strings.ReplaceAll(mode, "-", "_") + "."
		k := requireKafka(t, harness.ApacheKafkaOptions{Version: harness.ApacheKafka4Version, Proxied: true}, w.topics(), 1, nil)
		kafkaToxi = k.Toxi(0)
		t.Cleanup(func() { kafkaToxi.Heal(t) })
		w.Brokers = k.Brokers()
		flags = []string{"--progress-topic", "drill_slow_progress_" + strings.ReplaceAll(mode, "-", "_")}
	} else {
		var cluster *kfake.Cluster
		cluster, kafkaToxi = kfakeBehindToxi(t, w.topics())
		w.Brokers = cluster.ListenAddrs()
	}
	if len(w.Brokers) != 1 || w.Brokers[0] != kafkaToxi.Addr() {
		t.Fatalf("the broker advertises %v, not the proxy %s", w.Brokers, kafkaToxi.Addr())
	}
	w.Migrate()
	pgToxi := harness.StartToxi(t, fmt.Sprintf("127.0.0.1:%d", pg.Port()))
	w.relayThrough(pg, pgToxi)
	relay, pw, off := w.underLoad(rng, mode == "exactly-once", 200, append(flags, "--pg-timeout", "5s")...)
	streams := strings.Count(relay.Output(), harness.LogStreaming)
	pgToxi.Slow(t, 100, 50, 256)
	kafkaToxi.Slow(t, 100, 50, 256)
	slowFor := time.Duration(harness.Sized(20, 120)) * time.Second
	err := hold(slowFor, func() error {
		if relay.Exited() {
			return fmt.Errorf("relay exited on a slow link:\n%s", relay.Output())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	m, err := off.read(w.topics())
	if err != nil {
		t.Fatal(err)
	}
	duringSlow := sumOffsets(m)
	pgToxi.Heal(t)
	kafkaToxi.Heal(t)
	if err := pw.halt(); err != nil {
		t.Fatal(err)
	}
	records, dups := w.settle(mode == "exactly-once", 3*time.Minute)
	out := relay.Output()
	if strings.Contains(out, logSilent) {
		t.Errorf("the slow replication connection was taken for dead:\n%s", out)
	}
	restarts := strings.Count(out, harness.LogStreaming) - streams
	t.Logf("%s on %s: %v slow (100±50 ms each way, 256 KB/s, both links): Kafka's offsets at %d by its end; %d events, %d records, %d duplicates, %d session restarts, 0 lost, order kept",
		mode, broker, slowFor, duringSlow, w.CommittedCount(), len(records), dups, restarts)
}
