package harness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// The versions fetch.sh fetches by default must be the ones the harness
// names, or CI would fetch one version and the tests look for another.
func TestApacheKafkaVersionsMatchFetchScript(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "kafka", "fetch.sh"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^DEFAULT_VERSIONS="([^"]*)"`).FindSubmatch(b)
	if m == nil {
		t.Fatal("fetch.sh: no DEFAULT_VERSIONS line")
	}
	got := strings.Fields(string(m[1]))
	want := []string{ApacheKafka4Version, ApacheKafka3Version}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("fetch.sh DEFAULT_VERSIONS = %v, harness wants %v", got, want)
	}
}

func TestApacheKafkaOptionsKey(t *testing.T) {
	a := ApacheKafkaOptions{Settings: map[string]string{"a": "1", "b": "2"}}
	b := ApacheKafkaOptions{Version: ApacheKafka4Version, Nodes: 1, HeapMB: 384,
		Settings: map[string]string{"b": "2", "a": "1"}}
	if a.key() != b.key() {
		t.Fatalf("equal options after defaults have different keys:\n%s\n%s", a.key(), b.key())
	}
	c := ApacheKafkaOptions{Nodes: 3}
	if a.key() == c.key() {
		t.Fatal("different node counts share a key")
	}
}

// Produces 100 records to one partition of a single 4.x node with acks=all
// and idempotence, and reads them back in order.
func TestApacheKafkaSingleNodeRoundTrip(t *testing.T) {
	k := RequireApacheKafka(t, ApacheKafkaOptions{Version: ApacheKafka4Version, Nodes: 1})
	t.Logf("kafka %s, 1 node, started in %v", k.Version(), k.StartupTime().Round(time.Millisecond))
	roundTrip(t, k, uniqueTopic("roundtrip-4x"))
}

// The same round trip against 3.9, the last release before Kafka 4 dropped
// the old protocol versions.
func TestApacheKafka39RoundTrip(t *testing.T) {
	k := RequireApacheKafka(t, ApacheKafkaOptions{Version: ApacheKafka3Version, Nodes: 1})
	t.Logf("kafka %s, 1 node, started in %v", k.Version(), k.StartupTime().Round(time.Millisecond))
	roundTrip(t, k, uniqueTopic("roundtrip-39"))
}

func roundTrip(t *testing.T, k *ApacheKafka, topic string) {
	t.Helper()
	if err := k.CreateTopic(topic, 1, 1, nil); err != nil {
		t.Fatalf("%v%s", err, k.LogTail(0, 30))
	}
	cl := newProducer(t, k)
	produceRange(t, cl, topic, 0, 0, 100)
	checkRecords(t, k, topic, 0, 100)
}

// A 3-node quorum with RF 3 and min.insync.replicas=2 keeps accepting
// acks=all writes when a partition leader is SIGKILLed, loses nothing, and
// takes the node back.
func TestApacheKafkaThreeNodeFailover(t *testing.T) {
	k := RequireApacheKafka(t, ApacheKafkaOptions{
		Version:                  ApacheKafka4Version,
		Nodes:                    3,
		MinInsyncReplicas:        2,
		DefaultReplicationFactor: 3,
	})
	t.Logf("kafka %s, 3 nodes, started in %v", k.Version(), k.StartupTime().Round(time.Millisecond))
	topic := uniqueTopic("failover")
	if err := k.CreateTopic(topic, 3, 3, map[string]string{"min.insync.replicas": "2"}); err != nil {
		t.Fatal(err)
	}
	cl := newProducer(t, k)
	produceRange(t, cl, topic, 0, 0, 50)

	leader, err := k.PartitionLeader(topic, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("killing node %d, leader of %s/0", leader, topic)
	k.KillNode(leader)
	restarted := false
	t.Cleanup(func() {
		if !restarted { // leave the shared cluster whole for later tests
			if err := k.StartNode(leader); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		}
	})

	start := time.Now()
	produceRange(t, cl, topic, 0, 50, 100)
	t.Logf("50 acks=all records produced %v after the kill", time.Since(start).Round(time.Millisecond))
	newLeader, err := k.PartitionLeader(topic, 0)
	if err != nil {
		t.Fatal(err)
	}
	if newLeader == leader {
		t.Fatalf("partition leader is still the killed node %d", leader)
	}
	checkRecords(t, k, topic, 0, 100)

	start = time.Now()
	if err := k.StartNode(leader); err != nil {
		t.Fatalf("%v%s", err, k.LogTail(leader, 40))
	}
	restarted = true
	t.Logf("node %d back in sync after %v", leader, time.Since(start).Round(time.Millisecond))
	produceRange(t, cl, topic, 0, 100, 110)
	checkRecords(t, k, topic, 0, 110)
}

// uniqueTopic names a fresh topic, since a shared cluster outlives a test
// (and -count=N runs it again).
func uniqueTopic(prefix string) string {
	return prefix + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
}

func newProducer(t *testing.T, k *ApacheKafka) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(k.Brokers()...),
		kgo.RequiredAcks(kgo.AllISRAcks()), // idempotent writes are kgo's default
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerLinger(0),
		kgo.RecordDeliveryTimeout(90*time.Second),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// produceRange produces records with values from..to-1 to one partition,
// in order, and waits for every ack.
func produceRange(t *testing.T, cl *kgo.Client, topic string, partition int32, from, to int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	recs := make([]*kgo.Record, 0, to-from)
	for i := from; i < to; i++ {
		recs = append(recs, &kgo.Record{
			Topic:     topic,
			Partition: partition,
			Key:       []byte("k" + strconv.Itoa(i%7)),
			Value:     []byte(strconv.Itoa(i)),
		})
	}
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatalf("produce %d..%d: %v", from, to-1, err)
	}
}

// checkRecords reads topic/partition from the start with a fresh client
// and checks that it holds exactly the values 0..want-1, in order.
func checkRecords(t *testing.T, k *ApacheKafka, topic string, partition int32, want int) {
	t.Helper()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(k.Brokers()...),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{
			topic: {partition: kgo.NewOffset().AtStart()},
		}),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
	)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var got []string
	for len(got) < want {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("consumed %d of %d records before the deadline", len(got), want)
		}
		fs.EachError(func(topic string, p int32, err error) {
			t.Logf("fetch %s/%d: %v", topic, p, err)
		})
		fs.EachRecord(func(r *kgo.Record) { got = append(got, string(r.Value)) })
	}
	if len(got) != want {
		t.Fatalf("consumed %d records, want %d", len(got), want)
	}
	for i, v := range got {
		if v != strconv.Itoa(i) {
			t.Fatalf("record %d has value %q, want %q (order or loss broken): %v", i, v, fmt.Sprint(i), got)
		}
	}
}
