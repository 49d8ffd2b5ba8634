package drills

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Partition-count drills: what the relay does when an operator adds
// partitions to an event topic (docs/partitions.md).

// msgPartitionsChanged is the relay's warning when an event topic's
// partition count is no longer the one its keys are mapped by.
const msgPartitionsChanged = "the event topic's partition count changed"

// partitionsGauge and partitionsUsedGauge are the relay's gauges of an
// event topic's actual partition count and the count keys are mapped by.
const (
	partitionsGauge     = "outbox_relay_topic_partitions"
	partitionsUsedGauge = "outbox_relay_topic_partitions_used"
)

// TestDrillPartitionsAdded is issue 52's reproduction: partitions are
// added to the event topics (6 to 12) while a writer commits at a steady
// rate over 200 aggregates, and the relay is then restarted (SIGKILL, as a
// crash or a hasty deploy would). On the relay before the partition count
// was recorded, every key moved to murmur2 modulo 12 after the restart:
// 97 of 200 aggregates had records in two partitions, and a consumer group
// that lagged read an aggregate's newer events before its older ones. The
// relay must keep every key on the partition it had (mapped by the count
// it recorded), lose nothing, keep per-aggregate order for a lagging group
// consumer, and say so: its warning and gauges, while running and after
// the restart. Detection times are logged.
//
// Reduced: about 4 s of writing on each side of the change, at-least-once
// and exactly-once; OUTBOX_RELAY_DRILL_SIZE=full: 30 s, and the messages
// source too.
func TestDrillPartitionsAdded(t *testing.T) {
	cases := []struct {
		name     string
		source   string
		flags    []string
		fullOnly bool
	}{
		{name: "wal-at-least-once"},
		{name: "wal-exactly-once", flags: eosFlags},
		{name: "messages-at-least-once", source: "messages", fullOnly: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.fullOnly && harness.Sized(0, 1) == 0 {
				t.Skip("full size only (" + harness.DrillSizeEnv + "=full)")
			}
			pg := harness.StartPostgres(t, harness.PGOptions{})
			w := newWorld(t, pg, nil)
			if c.source == "messages" {
				w.Source = "messages"
				w.EmitMessages(t, w.DB, "outbox")
			}
			w.Brokers = startKfake(t, harness.KfakeOptions{}, w.topics()).Brokers()
			w.Migrate()
			partitionsAddedDrill(t, w, c.flags, len(c.flags) > 0)
		})
	}
}

// partitionsAddedDrill runs the reproduction on a migrated world whose
// topics have the drills' partition count.
func partitionsAddedDrill(t *testing.T, w *world, flags []string, exactlyOnce bool) {
	const aggregates = 200
	phase := time.Duration(harness.Sized(4, 30)) * time.Second
	rng := newRand(t)
	flags = append([]string{"--admin-addr", "127.0.0.1:0"}, flags...)

	pw := startPacedWriter(w, w.connect(), writerRand(rng), 20*time.Millisecond, 3, aggregates, false) // 150 events/s
	defer pw.halt()
	relay := w.startRelay(flags...)
	admin := relay.AdminURL(t)
	harness.WaitFor(t, time.Minute, "the relay publishes", func() bool { return sumOffsets(endOffsets(t, w.Brokers, w.topics())) > 0 })
	if _, ok := waitCond(30*time.Second, func() bool {
		v, ok := gaugeOf(t, admin, partitionsUsedGauge, w.topics()[0])
		return ok && v == partitions
	}); !ok {
		t.Errorf("the relay does not export %s=%d", partitionsUsedGauge, partitions)
	}

	// A group consumer reads what was published so far, commits, and then
	// lags: it reads nothing more until the writer stopped.
	lagging := newGroupReader(t, w.Brokers, "lagging-"+w.Slot, w.topicRegex())
	harness.WaitFor(t, time.Minute, "the group consumer reads the first events", func() bool {
		lagging.poll(t, time.Second)
		return lagging.count() >= 100
	})
	lagging.commit(t)
	mark := pw.events.Load()
	harness.WaitFor(t, 2*phase+time.Minute, "the writer commits one phase more", func() bool {
		return pw.events.Load() >= mark+int64(phase/(20*time.Millisecond))*3
	})

	const raised = 2 * partitions
	changed := time.Now()
	addPartitions(t, w.Brokers, w.topics(), raised)
	t.Logf("partitions raised from %d to %d on %d topics with %d events committed", partitions, raised, len(w.topics()), pw.events.Load())

	// The running relay notices the change from the brokers' metadata.
	if d, ok := waitCond(30*time.Second, func() bool {
		v, ok := gaugeOf(t, admin, partitionsGauge, w.topics()[0])
		return ok && v == raised
	}); ok {
		t.Logf("detection while running: %s exported %d %v after the change", partitionsGauge, raised, d.Round(time.Millisecond))
	} else {
		t.Errorf("the running relay did not export %s=%d within 30s of the change", partitionsGauge, raised)
	}
	if !strings.Contains(relay.Output(), msgPartitionsChanged) {
		t.Errorf("the running relay did not log %q", msgPartitionsChanged)
	}
	relay.Kill()
	relay = w.startRelayNoWait(flags...)
	admin = relay.AdminURL(t)
	if d, ok := waitCond(30*time.Second, func() bool {
		v, ok := gaugeOf(t, admin, partitionsGauge, w.topics()[0])
		used, uok := gaugeOf(t, admin, partitionsUsedGauge, w.topics()[0])
		return ok && uok && v == raised && used == partitions
	}); ok {
		t.Logf("detection after the restart: %v after the relay started (%v after the change)",
			d.Round(time.Millisecond), time.Since(changed).Round(time.Millisecond))
	} else {
		t.Errorf("the restarted relay did not export %s=%d and %s=%d", partitionsGauge, raised, partitionsUsedGauge, partitions)
	}
	mark = pw.events.Load()
	harness.WaitFor(t, 2*phase+time.Minute, "the writer commits one phase more after the restart", func() bool {
		return pw.events.Load() >= mark+int64(phase/(20*time.Millisecond))*3
	})
	if err := pw.halt(); err != nil {
		t.Fatalf("writer: %v", err)
	}
	if !strings.Contains(relay.Output(), msgPartitionsChanged) {
		t.Errorf("the restarted relay did not log %q", msgPartitionsChanged)
	}

	var records []harness.Record
	if exactlyOnce {
		records = w.settleExactlyOnce(3 * time.Minute)
	} else {
		records = w.waitSettled(3 * time.Minute)
	}
	ids, order := w.Committed()
	split := splitAggregates(records)
	harness.CheckNoLoss(t, records, ids)
	lost := countLost(records, ids)
	if len(split) > 0 {
		t.Errorf("%d of %d aggregates have records in more than one partition, e.g. %s", len(split), len(order), sample(split, 5))
	}
	harness.CheckPerAggregateOrder(t, records, order)

	// The lagging group now reads everything that is left, in the order a
	// group member gets it.
	harness.WaitFor(t, 3*time.Minute, "the lagging group consumer reads every event", func() bool {
		lagging.poll(t, time.Second)
		return lagging.covers(ids)
	})
	breaks := lagging.orderBreaks(w.CommitIndex())
	if breaks > 0 {
		t.Errorf("the lagging group consumer read %d aggregates' events out of commit order", breaks)
	}
	t.Logf("%d events over %d aggregates: %d aggregates split across partitions, %d lost, %d aggregates read out of order by the lagging group",
		len(ids), len(order), len(split), lost, breaks)
}

// addPartitions raises the partition count of topics to n, as an operator
// does with kafka-topics --alter --partitions.
func addPartitions(t testing.TB, brokers, topics []string, n int) {
	t.Helper()
	cl := harness.NewKgoClient(t, brokers)
	adm := kadm.NewClient(cl)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := adm.UpdatePartitions(ctx, n, topics...)
	if err == nil {
		err = resp.Error()
	}
	if err != nil {
		t.Fatalf("raise the partitions of %v to %d: %v", topics, n, err)
	}
}

// gaugeOf reads a gauge of one topic from the relay's /metrics; ok is false
// when it is not exported (yet).
func gaugeOf(t testing.TB, admin, name, topic string) (float64, bool) {
	t.Helper()
	return harness.MetricValue(harness.Scrape(t, admin), name, "topic", topic)
}

// waitCond polls cond every 100ms until it holds or timeout passes, and
// says how long it took.
func waitCond(timeout time.Duration, cond func() bool) (time.Duration, bool) {
	start := time.Now()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if cond() {
			return time.Since(start), true
		}
		if time.Since(start) > timeout {
			return time.Since(start), false
		}
		<-tick.C
	}
}

// splitAggregates returns the aggregates (topic/key) whose records sit in
// more than one partition, with the partitions.
func splitAggregates(records []harness.Record) map[string]map[int32]bool {
	parts := map[string]map[int32]bool{}
	for _, r := range records {
		k := r.Topic + "/" + string(r.Key)
		if parts[k] == nil {
			parts[k] = map[int32]bool{}
		}
		parts[k][r.Partition] = true
	}
	for k, p := range parts {
		if len(p) < 2 {
			delete(parts, k)
		}
	}
	return parts
}

func sample(split map[string]map[int32]bool, n int) string {
	var out []string
	for k, p := range split {
		if len(out) == n {
			break
		}
		out = append(out, fmt.Sprintf("%s in %d partitions", k, len(p)))
	}
	return strings.Join(out, ", ")
}

// countLost counts the events of want no record carries.
func countLost(records []harness.Record, want []string) int {
	got := make(map[string]bool, len(records))
	for _, r := range records {
		got[r.EventID()] = true
	}
	lost := 0
	for _, id := range want {
		if !got[id] {
			lost++
		}
	}
	return lost
}

// groupReader is a consumer group member reading with the independent
// client, keeping every record in the order it was handed them.
type groupReader struct {
	cl   *kgo.Client
	mu   sync.Mutex
	seen []harness.Record
	ids  map[string]bool
}

func newGroupReader(t testing.TB, brokers []string, group, topicRegex string) *groupReader {
	t.Helper()
	cl := harness.NewKgoClient(t, brokers, kgo.ConsumerGroup(group), kgo.ConsumeRegex(), kgo.ConsumeTopics(topicRegex),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.DisableAutoCommit(), kgo.MetadataMinAge(250*time.Millisecond), kgo.MetadataMaxAge(time.Second))
	return &groupReader{cl: cl, ids: map[string]bool{}}
}

// poll reads what arrives within d.
func (g *groupReader) poll(t testing.TB, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	fetches := g.cl.PollFetches(ctx)
	g.mu.Lock()
	defer g.mu.Unlock()
	fetches.EachRecord(func(r *kgo.Record) {
		rec := harness.Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Headers: map[string]string{}}
		for _, h := range r.Headers {
			rec.Headers[h.Key] = string(h.Value)
		}
		g.seen = append(g.seen, rec)
		g.ids[rec.EventID()] = true
	})
}

// commit commits what the member has read.
func (g *groupReader) commit(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := g.cl.CommitUncommittedOffsets(ctx); err != nil {
		t.Fatalf("commit the group's offsets: %v", err)
	}
}

func (g *groupReader) count() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.seen)
}

func (g *groupReader) covers(ids []string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, id := range ids {
		if !g.ids[id] {
			return false
		}
	}
	return true
}

// orderBreaks counts the aggregates of which the member was handed an
// event before one committed earlier, first reads only (a redelivery is
// the consumer's to skip).
func (g *groupReader) orderBreaks(index map[string]int) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	last := map[string]int{}
	broken := map[string]bool{}
	seen := map[string]bool{}
	for _, r := range g.seen {
		id := r.EventID()
		i, ok := index[id]
		if !ok || seen[id] {
			continue
		}
		seen[id] = true
		agg := r.Topic + "/" + string(r.Key)
		if prev, ok := last[agg]; ok && i < prev {
			broken[agg] = true
			continue
		}
		last[agg] = i
	}
	return len(broken)
}

// TestDrillPartitionsFewer: an event topic deleted and made again with
// fewer partitions than its keys are mapped by. The relay must publish
// nothing to it and stop, exit 1, naming the topic, both counts and the
// command to run.
func TestDrillPartitionsFewer(t *testing.T) {
	w, _ := newKfakeWorld(t, shared)
	conn := w.connect()
	rng := newRand(t)
	if err := w.writeTxns(conn, rng, 20, 5, 50); err != nil {
		t.Fatal(err)
	}
	relay := w.startRelay()
	w.consumeAll(time.Minute)
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("stop the relay: exit %d, %v", code, err)
	}
	topic := w.topics()[0]
	harness.DeleteTopic(t, w.Brokers, topic)
	harness.CreateTopic(t, w.Brokers, topic, partitions/2, nil)
	if err := w.writeTxns(conn, rng, 5, 5, 50); err != nil {
		t.Fatal(err)
	}
	relay = w.startRelayNoWait()
	code, err := relay.Wait(2 * time.Minute)
	if err != nil {
		t.Fatalf("the relay did not stop: %v\n%s", err, harness.LastLines(relay.Output(), 20))
	}
	out := relay.Output()
	want := []string{topic, fmt.Sprintf("has %d partitions, fewer than the %d", partitions/2, partitions), "partitions adopt --event-topic " + topic}
	for _, s := range want {
		if !strings.Contains(out, s) {
			t.Errorf("the relay's output lacks %q:\n%s", s, harness.LastLines(out, 10))
		}
	}
	if code != 1 {
		t.Errorf("the relay exited %d, want 1", code)
	}
	if _, n := harness.TopicRecords(t, w.Brokers, topic); n != 0 {
		t.Errorf("the relay published %d records to the smaller topic", n)
	}
}
