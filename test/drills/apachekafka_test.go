package drills

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillLeaderFailover SIGKILLs the leader of a partition the relay is
// writing to, on a three-broker Apache Kafka cluster (replication factor 3,
// min.insync.replicas=2), mid-stream. acks=all writes survive on the other
// replicas and a new leader takes over; the producer must find it, and its
// retries must neither lose nor reorder (sarama #1430 idempotence broken on
// reconnect, #2611 OutOfOrderSequenceNumber after a reconnect, #2619 and
// #2860 reordering on retry). The node is restarted afterwards and the
// relay keeps delivering.
func TestDrillLeaderFailover(t *testing.T) {
	rng := newRand(t)
	w, k := newFailoverWorld(t, "drill_failover.")
	conn := w.connect()
	relay := w.startRelay()
	if err := w.writeTxns(conn, rng, 10, 5, 300); err != nil {
		t.Fatal(err)
	}
	w.consumeAll(time.Minute)

	wrng := writerRand(rng)
	wait := runWriter(func() error { return w.writeTxns(conn, wrng, 600, 10, 300) })
	harness.WaitFor(t, time.Minute, "the writer is under way", func() bool { return w.CommittedCount() > 1500 })
	topic := w.topics()[0]
	leader, restart := killPartitionLeader(t, k, topic)
	killed, atKill := time.Now(), w.CommittedCount()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	w.consumeAll(3 * time.Minute)
	t.Logf("killed node %d, leader of %s/0, with %d events committed; all %d delivered %v after the kill",
		leader, topic, atKill, w.CommittedCount(), time.Since(killed).Round(time.Millisecond))
	newLeader, err := k.PartitionLeader(topic, 0)
	if err != nil {
		t.Fatal(err)
	}
	if newLeader == leader {
		t.Fatalf("partition %s/0 is still led by the killed node %d", topic, leader)
	}

	restart()
	if err := w.writeTxns(conn, rng, 50, 10, 300); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	t.Logf("%d records for %d events (%d duplicates), %d stream restarts", len(records), w.CommittedCount(),
		len(records)-w.CommittedCount(), strings.Count(relay.Output(), msgRestart))
}

// newFailoverWorld is a migrated world whose topics (named with prefix)
// live on the shared three-broker Apache Kafka cluster with replication
// factor 3 and min.insync.replicas=2, so one broker may die.
func newFailoverWorld(t *testing.T, prefix string) (*world, *harness.ApacheKafka) {
	t.Helper()
	w := newWorld(t, shared, nil)
	w.topicPrefix = prefix
	k := requireKafka(t, harness.ApacheKafkaOptions{
		Version: harness.ApacheKafka4Version, Nodes: 3, MinInsyncReplicas: 2, DefaultReplicationFactor: 3,
	}, w.topics(), 3, map[string]string{"min.insync.replicas": "2"})
	w.Brokers = k.Brokers()
	w.Migrate()
	return w, k
}

// killPartitionLeader SIGKILLs the node leading topic/0; see killNode.
func killPartitionLeader(t *testing.T, k *harness.ApacheKafka, topic string) (leader int, restart func()) {
	t.Helper()
	leader, err := k.PartitionLeader(topic, 0)
	if err != nil {
		t.Fatal(err)
	}
	return leader, killNode(t, k, leader)
}

// killNode SIGKILLs node i. restart starts it again; the test's cleanup
// does if the test did not, to leave a shared cluster whole for later
// tests.
func killNode(t *testing.T, k *harness.ApacheKafka, i int) (restart func()) {
	t.Helper()
	k.KillNode(i)
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			if err := k.StartNode(i); err != nil {
				t.Errorf("cleanup: restart node %d: %v", i, err)
			}
		}
	})
	return func() {
		t.Helper()
		if err := k.StartNode(i); err != nil {
			t.Fatalf("restart node %d: %v%s", i, err, k.LogTail(i, 40))
		}
		restarted = true
	}
}

// TestDrillApacheKafkaEndToEnd runs the main delivery contract against real
// Apache Kafka, 4.x (which dropped the old protocol versions, KIP-896) and
// 3.9 (the last of the previous generation): exact keys, values and
// headers, the Java client's partition for each key on topics created with
// a known partition count, and per-aggregate commit order, all read with
// franz-go; then the same records read with kcat (librdkafka), a consumer
// that shares no code with either.
func TestDrillApacheKafkaEndToEnd(t *testing.T) {
	for _, version := range []string{harness.ApacheKafka4Version, harness.ApacheKafka3Version} {
		t.Run(version, func(t *testing.T) {
			rng := newRand(t)
			w := newWorld(t, shared, nil)
			w.topicPrefix = "drill_e2e_" + strings.ReplaceAll(version, ".", "_") + "."
			k := requireKafka(t, harness.ApacheKafkaOptions{Version: version, Nodes: 1}, w.topics(), 1, nil)
			w.Brokers = k.Brokers()
			w.Migrate()
			relay := w.startRelay()
			if err := w.writeTxns(w.connect(), rng, 200, 10, 300); err != nil {
				t.Fatal(err)
			}
			records := w.waitSettled(2 * time.Minute)
			w.checkDelivery(records)
			if len(records) != w.CommittedCount() {
				t.Errorf("%d records for %d events in a run without failures", len(records), w.CommittedCount())
			}
			checkAgainstTable(t, w, records)
			if relay.Exited() {
				t.Fatalf("relay exited:\n%s", relay.Output())
			}
			t.Run("kcat", func(t *testing.T) { checkWithKcat(t, w, records) })
		})
	}
}

// checkAgainstTable compares every record with its row: topic, key, value,
// the six standard headers, the row's own headers, and the partition the
// Java client picks for the key.
func checkAgainstTable(t *testing.T, w *world, records []harness.Record) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), w.DB.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(context.Background(), `
		SELECT event_id::text, aggregate_type, aggregate_id, event_type, schema_version::text, payload::text,
		       COALESCE(headers->>'tenant', ''), COALESCE(headers->>'traceparent', ''),
		       to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
		FROM outbox_events`)
	if err != nil {
		t.Fatal(err)
	}
	type want struct{ aggType, aggID, eventType, version, payload, tenant, traceparent, occurred string }
	expected := map[string]want{}
	for rows.Next() {
		var id string
		var x want
		if err := rows.Scan(&id, &x.aggType, &x.aggID, &x.eventType, &x.version, &x.payload, &x.tenant, &x.traceparent, &x.occurred); err != nil {
			t.Fatal(err)
		}
		expected[id] = x
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	bad := 0
	for _, r := range records {
		x, ok := expected[r.EventID()]
		var problems []string
		switch {
		case !ok:
			problems = append(problems, "unknown event_id")
		default:
			if r.Topic != w.topicPrefix+x.aggType {
				problems = append(problems, "topic "+r.Topic)
			}
			if string(r.Key) != x.aggID || string(r.Value) != x.payload {
				problems = append(problems, fmt.Sprintf("key %q value %q", r.Key, r.Value))
			}
			if p := harness.JavaPartition(r.Key, partitions); r.Partition != p {
				problems = append(problems, fmt.Sprintf("partition %d, the Java client picks %d", r.Partition, p))
			}
			h := r.Headers
			if h["event_type"] != x.eventType || h["aggregate_type"] != x.aggType || h["aggregate_id"] != x.aggID ||
				h["schema_version"] != x.version || !harness.SameInstant(h["occurred_at"], x.occurred) {
				problems = append(problems, fmt.Sprintf("standard headers %v", h))
			}
			if h["tenant"] != x.tenant || h["traceparent"] != x.traceparent {
				problems = append(problems, fmt.Sprintf("row headers tenant=%q traceparent=%q, want %q %q", h["tenant"], h["traceparent"], x.tenant, x.traceparent))
			}
			if wantN := 6 + btoi(x.tenant != "") + btoi(x.traceparent != ""); len(r.HeaderKeys) != wantN {
				problems = append(problems, fmt.Sprintf("%d headers %v, want %d", len(r.HeaderKeys), r.HeaderKeys, wantN))
			}
		}
		if len(problems) > 0 {
			bad++
			if bad <= 20 {
				t.Errorf("record %s/%d@%d (event %s): %s", r.Topic, r.Partition, r.Offset, r.EventID(), strings.Join(problems, "; "))
			}
		}
	}
	if bad > 20 {
		t.Errorf("... %d records wrong in all", bad)
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// RequireKcatEnv names the environment variable that makes a missing kcat
// a failure rather than a skip. CI sets it.
const RequireKcatEnv = "OUTBOX_RELAY_REQUIRE_KCAT"

// checkWithKcat reads every drill topic with kcat and checks that it sees
// exactly the records franz-go saw: same event ids, partitions and keys.
func checkWithKcat(t *testing.T, w *world, records []harness.Record) {
	kcat, err := exec.LookPath("kcat")
	if err != nil {
		kcat, err = exec.LookPath("kafkacat")
	}
	if err != nil {
		msg := "kcat (librdkafka) is not installed, so the independent librdkafka check did NOT run; install it (apt-get install kcat)"
		if os.Getenv(RequireKcatEnv) == "1" {
			t.Fatal(msg)
		}
		t.Skip("SKIPPING: " + msg + "; set " + RequireKcatEnv + "=1 to make this a failure")
	}
	type seen struct {
		partition string
		key       string
	}
	want := map[string]seen{}
	for _, r := range records {
		want[r.EventID()] = seen{fmt.Sprint(r.Partition), string(r.Key)}
	}
	got := map[string]seen{}
	lines := 0
	for _, topic := range w.topics() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		cmd := exec.CommandContext(ctx, kcat, "-C", "-b", strings.Join(w.Brokers, ","), "-t", topic,
			"-o", "beginning", "-e", "-q", "-f", `%p|%k|%h\n`,
			"-X", "isolation.level=read_committed") // librdkafka's default, said for the exactly-once drills
		out, err := cmd.Output()
		cancel()
		if err != nil {
			stderr := ""
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = string(ee.Stderr)
			}
			t.Fatalf("kcat on %s: %v\n%s", topic, err, stderr)
		}
		sc := bufio.NewScanner(strings.NewReader(string(out)))
		for sc.Scan() {
			line := sc.Text()
			if line == "" {
				continue
			}
			lines++
			parts := strings.SplitN(line, "|", 3)
			if len(parts) != 3 {
				t.Fatalf("kcat line %q: want partition|key|headers", line)
			}
			id := ""
			for _, h := range strings.Split(parts[2], ",") {
				if v, ok := strings.CutPrefix(h, "event_id="); ok {
					id = v
				}
			}
			if id == "" {
				t.Errorf("kcat record without event_id header: %q", line)
				continue
			}
			if _, dup := got[id]; dup {
				t.Errorf("kcat saw event %s twice", id)
			}
			got[id] = seen{parts[0], parts[1]}
		}
	}
	if lines != len(records) {
		t.Errorf("kcat read %d records, franz-go %d", lines, len(records))
	}
	for id, s := range want {
		if g, ok := got[id]; !ok {
			t.Errorf("kcat did not see event %s", id)
		} else if g != s {
			t.Errorf("event %s: kcat saw partition %s key %q, franz-go partition %s key %q", id, g.partition, g.key, s.partition, s.key)
		}
	}
	t.Logf("kcat (librdkafka) read the same %d records: event ids, partitions and keys match", lines)
}
