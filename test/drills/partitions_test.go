package drills

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"syscall"
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
// Every source: wal in both delivery modes, messages and poll
// at-least-once. Reduced: about 4 s of writing on each side of the change;
// OUTBOX_RELAY_DRILL_SIZE=full: 30 s.
func TestDrillPartitionsAdded(t *testing.T) {
	cases := []struct {
		name   string
		source string
		flags  []string
	}{
		{name: "wal-at-least-once"},
		{name: "wal-exactly-once", flags: eosFlags},
		{name: "messages-at-least-once", source: "messages"},
		{name: "poll-at-least-once", source: "poll"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pg := harness.StartPostgres(t, harness.PGOptions{})
			w := newWorld(t, pg, nil)
			switch c.source {
			case "messages":
				w.Source = "messages"
				w.EmitMessages(t, w.DB, "outbox")
			case "poll":
				w.Source = "poll"
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
	relay := w.startSource(flags...)
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
	switch {
	case w.Source == "poll":
		records = w.settlePolled(3 * time.Minute)
	case exactlyOnce:
		records = w.settleExactlyOnce(3 * time.Minute)
	default:
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

// startSource starts the relay and waits until it reads its source:
// streaming, or for poll mode polling.
func (w *world) startSource(flags ...string) *harness.Process {
	w.T.Helper()
	if w.Source != "poll" {
		return w.startRelay(flags...)
	}
	p := w.startRelayNoWait(flags...)
	p.WaitForOutput(w.T, `"message":"polling"`, time.Minute)
	return p
}

// settlePolled is waitSettled for poll mode, which has no slot to confirm
// a fence: it waits until no row is left unpublished, then reads until
// every committed event is in Kafka.
func (w *world) settlePolled(timeout time.Duration) []harness.Record {
	w.T.Helper()
	harness.WaitFor(w.T, timeout, "the poller publishes every row", func() bool {
		return w.DB.QueryInt64(w.T, "SELECT count(*) FROM outbox_events_poll WHERE published_at IS NULL") == 0
	})
	ids, _ := w.Committed()
	return harness.ConsumeEventIDs(w.T, w.Brokers, w.topicRegex(), ids, timeout)
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

// adoptArgs are partitions adopt's flags for the drill's first topic.
func (w *world) adoptArgs(groups string) []string {
	return w.partitionsArgs("adopt", "--event-topic", w.topics()[0], "--consumer-groups", groups)
}

// partitionsArgs is a partitions subcommand's command line.
func (w *world) partitionsArgs(sub string, extra ...string) []string {
	return append([]string{"partitions", sub, "--pg-dsn", w.relayDSN, "--slot", w.Slot, "--kafka-brokers", strings.Join(w.Brokers, ",")}, extra...)
}

// partitionsWorld is a migrated world on the shared PostgreSQL whose
// topics have the drills' partition count, on its own kfake cluster or,
// for "apache-kafka", on the shared one-node Apache Kafka 4 cluster with
// topics named after prefix.
func partitionsWorld(t *testing.T, kafka, prefix string) *world {
	t.Helper()
	w := newWorld(t, shared, nil)
	if kafka == "apache-kafka" {
		w.topicPrefix = prefix
		k := requireKafka(t, harness.ApacheKafkaOptions{Version: harness.ApacheKafka4Version, Nodes: 1}, w.topics(), 1, nil)
		w.Brokers = k.Brokers()
	} else {
		w.Brokers = startKfake(t, harness.KfakeOptions{}, w.topics()).Brokers()
	}
	w.Migrate()
	return w
}

// partitionsKafkas are the brokers the adopt drills run on.
var partitionsKafkas = []string{"kfake", "apache-kafka"}

// TestDrillPartitionsAdopt follows docs/partitions.md's procedure
// literally while a writer keeps committing at a steady rate (150
// events/s over 200 aggregates) in exactly-once mode: partitions added,
// the relay stopped, adopt run until it accepts while the group consumer
// catches up, the relay started. Nothing may be lost; the group consumer,
// which read everything before the adoption and reads on after it, must
// read every aggregate in commit order; each aggregate's records must sit
// on its old partition (murmur2 mod 6) and then only on its new one
// (murmur2 mod 12), each side in commit order; and events after the
// adoption must reach the new partitions.
//
// The group consumer is franz-go, read_committed, committing the offset
// after the last record it was handed: one short of each partition's end,
// on the commit marker of the relay's last Kafka transaction. adopt must
// see that it read everything (it refused for ever before).
func TestDrillPartitionsAdopt(t *testing.T) {
	for _, kafka := range partitionsKafkas {
		t.Run(kafka, func(t *testing.T) {
			adoptDrill(t, partitionsWorld(t, kafka, "drill_adopt."))
		})
	}
}

func adoptDrill(t *testing.T, w *world) {
	const aggregates = 200
	rng := newRand(t)
	group := "billing-" + w.Slot
	reader := newGroupReader(t, w.Brokers, group, w.topicRegex())
	pw := startPacedWriter(w, w.connect(), writerRand(rng), 20*time.Millisecond, 3, aggregates, false) // 150 events/s
	defer pw.halt()
	relay := w.startRelay(eosFlags...)
	harness.WaitFor(t, time.Minute, "the group reads the first events", func() bool {
		reader.poll(t, 500*time.Millisecond)
		return reader.count() >= 200
	})
	const raised = 2 * partitions
	addPartitions(t, w.Brokers, w.topics(), raised)

	// 1. Stop the relay.
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("stop the relay: exit %d, %v\n%s", code, err, relay.Output())
	}
	stoppedAt := pw.events.Load()
	// 2. and 3. Wait for the group, running adopt until it accepts. The
	// group consumer read nothing since its first events and committed
	// nothing yet: adopt must refuse first, and the consumer reads and
	// commits after each refusal.
	var out, refused string
	start := time.Now()
	refusals := 0
	harness.WaitFor(t, 2*time.Minute, "partitions adopt accepts", func() bool {
		var code int
		code, out = harness.RunCommand(t, w.Bin, w.adoptArgs(group))
		if code == 2 {
			t.Fatalf("partitions adopt: exit 2:\n%s", out)
		}
		if code == 0 {
			return true
		}
		refusals++
		refused = out
		if !strings.Contains(out, "not read to the end") {
			t.Fatalf("partitions adopt refused, exit %d, for another reason than a group behind:\n%s", code, out)
		}
		reader.poll(t, 500*time.Millisecond)
		reader.commit(t)
		return false
	})
	adoptAfter := time.Since(start)
	t.Logf("adopt accepted after %d refusals, %v after the relay stopped: %s", refusals, adoptAfter.Round(time.Millisecond), strings.TrimSpace(out))
	if refusals == 0 {
		t.Errorf("adopt accepted at once, while the group consumer had committed nothing")
	} else {
		t.Logf("the last refusal: %s", harness.LastLines(refused, 1))
	}
	if !strings.Contains(out, fmt.Sprintf("keys are mapped by %d partitions", raised)) {
		t.Errorf("adopt accepted without saying the new count %d:\n%s", raised, out)
	}
	if n := w.DB.QueryInt64(t, "SELECT partitions FROM outbox_relay_partitions WHERE topic = $1", w.topics()[0]); n != raised {
		t.Errorf("after adopt %s is recorded with %d partitions, want %d", w.topics()[0], n, raised)
	}
	// 4. Start the relay.
	adoptedAt := pw.events.Load()
	relay = w.startRelay(eosFlags...)
	mark := pw.events.Load()
	harness.WaitFor(t, 2*time.Minute, "the writer commits 600 events after the restart", func() bool { return pw.events.Load() >= mark+600 })
	if err := pw.halt(); err != nil {
		t.Fatalf("writer: %v", err)
	}
	records := w.settleAdopted(3 * time.Minute)
	if relay.Exited() {
		t.Fatalf("the relay started after the adoption exited:\n%s", harness.LastLines(relay.Output(), 20))
	}
	ids, order := w.Committed()
	harness.CheckNoLoss(t, records, ids)
	lost := countLost(records, ids)
	sides := checkAdoptedPlacement(t, records, order, w.topics(), raised)
	harness.WaitFor(t, 3*time.Minute, "the group reads every event", func() bool {
		reader.poll(t, time.Second)
		return reader.covers(ids)
	})
	breaks := reader.orderBreaks(w.CommitIndex())
	if breaks > 0 {
		t.Errorf("the group consumer read %d aggregates' events out of commit order", breaks)
	}
	// Events committed after the relay started again go by the new count.
	index := w.CommitIndex()
	moved, wrong := 0, 0
	for _, r := range harness.FirstDeliveries(records) {
		if r.Topic != w.topics()[0] || index[r.EventID()] < int(adoptedAt)+int(pw.events.Load()-adoptedAt)/2 {
			continue
		}
		if want := harness.JavaPartition(r.Key, raised); r.Partition != want {
			wrong++
		} else if r.Partition >= partitions {
			moved++
		}
	}
	if wrong > 0 || moved == 0 {
		t.Errorf("after the adoption %d records of %s are not on murmur2 mod %d, %d on the new partitions", wrong, w.topics()[0], raised, moved)
	}
	t.Logf("%d events over %d aggregates (%d committed while the relay was stopped): adopt accepted %v after the stop, %d refusals; "+
		"%d lost; %d aggregates out of order for the group; %d aggregates moved to their new partition; %d late records of %s on partitions %d-%d",
		len(ids), len(order), adoptedAt-stoppedAt, adoptAfter.Round(time.Millisecond), refusals, lost, breaks, sides, moved, w.topics()[0], partitions, raised-1)
}

// settleAdopted is settleExactlyOnce for a drill that changed the mapping:
// a fence transaction, confirmed by the slot, then every committed event
// read read_committed, each exactly once; per-aggregate placement and
// order are checkAdoptedPlacement's, since an adopted aggregate moves
// partition once.
func (w *world) settleAdopted(timeout time.Duration) []harness.Record {
	w.T.Helper()
	conn := w.connect()
	var markers []harness.OutboxEvent
	for _, typ := range w.types {
		markers = append(markers, harness.OutboxEvent{AggregateType: typ, AggregateID: "settle-" + typ, EventType: "Settled", Payload: `{"marker": true}`})
	}
	commit := w.fence(conn, markers)
	harness.WaitFor(w.T, timeout, "the slot confirms the settle transaction (commit at "+commit+")", func() bool {
		return !notPast(w.ConfirmedFlush(), commit)
	})
	ids, _ := w.Committed()
	return harness.ConsumeExactlyOnce(w.T, w.Brokers, w.topicRegex(), ids, timeout)
}

// checkAdoptedPlacement checks every aggregate's records (first
// deliveries) in commit order: on the partition murmur2 mod the drills'
// count gives, then, once it moved, only on the one murmur2 mod raised
// gives, at rising offsets on each. It returns how many aggregates moved.
func checkAdoptedPlacement(t *testing.T, records []harness.Record, order map[string][]string, topics []string, raised int32) int {
	t.Helper()
	first := map[string]harness.Record{}
	for _, r := range harness.FirstDeliveries(records) {
		first[r.EventID()] = r
	}
	moved, bad := 0, 0
	for agg, ids := range order {
		var prev harness.Record
		onNew := false
		for i, id := range ids {
			r, ok := first[id]
			if !ok {
				continue // CheckNoLoss names it
			}
			old, now := harness.JavaPartition(r.Key, partitions), harness.JavaPartition(r.Key, raised)
			switch {
			case !onNew && r.Partition == old:
			case r.Partition == now:
				if !onNew && i > 0 && now != old {
					moved++
				}
				onNew = true
			default:
				t.Errorf("aggregate %s: event #%d on %s/%d, neither its partition by %d (%d) nor, after the adoption, by %d (%d)",
					agg, i+1, r.Topic, r.Partition, partitions, old, raised, now)
				bad++
			}
			if i > 0 && r.Partition == prev.Partition && r.Offset < prev.Offset {
				t.Errorf("aggregate %s: event #%d at %s/%d@%d, before event #%d at offset %d", agg, i+1, r.Topic, r.Partition, r.Offset, i, prev.Offset)
				bad++
			}
			prev = r
			if bad > 10 {
				t.Fatalf("more than 10 placement errors over %v", topics)
			}
		}
	}
	return moved
}

// TestDrillPartitionsAdoptRefuses: partitions adopt refuses while the
// relay runs, and while a named group has not read the topic to its end,
// each time saying what to do, and records nothing.
func TestDrillPartitionsAdoptRefuses(t *testing.T) {
	for _, kafka := range partitionsKafkas {
		t.Run(kafka, func(t *testing.T) {
			adoptRefusesDrill(t, partitionsWorld(t, kafka, "drill_adopt_refuses."))
		})
	}
}

func adoptRefusesDrill(t *testing.T, w *world) {
	conn := w.connect()
	if err := w.writeTxns(conn, newRand(t), 20, 5, 50); err != nil {
		t.Fatal(err)
	}
	relay := w.startRelay()
	w.consumeAll(time.Minute)
	addPartitions(t, w.Brokers, w.topics(), 2*partitions)
	group := "late-" + w.Slot
	code, out := harness.RunCommand(t, w.Bin, w.adoptArgs(group))
	if code != 1 || !strings.Contains(out, "a relay is streaming replication slot") || !strings.Contains(out, "Stop it first") {
		t.Errorf("adopt with the relay running: exit %d, want 1 naming the running relay and what to do:\n%s", code, out)
	}
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("stop the relay: exit %d, %v", code, err)
	}
	code, out = harness.RunCommand(t, w.Bin, w.adoptArgs(group))
	if code != 1 || !strings.Contains(out, "not read to the end") || !strings.Contains(out, "nothing committed") || !strings.Contains(out, "run this command again") {
		t.Errorf("adopt with a group that read nothing: exit %d, want 1 saying how far it is behind and what to do:\n%s", code, out)
	}
	code, out = harness.RunCommand(t, w.Bin, w.partitionsArgs("adopt", "--event-topic", w.topics()[0]))
	if code != 2 || !strings.Contains(out, "--consumer-groups is required") {
		t.Errorf("adopt without --consumer-groups: exit %d, want 2:\n%s", code, out)
	}
	if n := w.DB.QueryInt64(t, "SELECT partitions FROM outbox_relay_partitions WHERE topic = $1", w.topics()[0]); n != partitions {
		t.Errorf("a refused adopt recorded %d partitions, want %d unchanged", n, partitions)
	}
	code, out = harness.RunCommand(t, w.Bin, w.partitionsArgs("show"))
	if code != 0 || !strings.Contains(out, "partitions 6-11 unused") {
		t.Errorf("partitions show: exit %d, want 0 showing the unused partitions:\n%s", code, out)
	}
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

// TestDrillPartitionsRegistryMissing: a relay upgraded without running
// migrate (docs/upgrades.md) finds no outbox_relay_partitions. It must
// publish nothing and stop, exit 1, naming the table and saying to run
// migrate: at its start, with events waiting and with none (an idle
// outbox, where the first record may come hours later); after migrate it
// starts and delivers everything.
func TestDrillPartitionsRegistryMissing(t *testing.T) {
	w, _ := newKfakeWorld(t, shared)
	w.DB.Exec(t, "DROP TABLE outbox_relay_partitions")
	stops := func(what string) {
		t.Helper()
		relay := w.startRelayNoWait()
		code, err := relay.Wait(2 * time.Minute)
		if err != nil {
			t.Fatalf("%s: the relay did not stop: %v\n%s", what, err, harness.LastLines(relay.Output(), 20))
		}
		out := relay.Output()
		for _, s := range []string{"partition count registry public.outbox_relay_partitions does not exist", "run `outbox-relay migrate`"} {
			if !strings.Contains(out, s) {
				t.Errorf("%s: the relay's output lacks %q:\n%s", what, s, harness.LastLines(out, 10))
			}
		}
		if strings.Contains(out, `"message":"streaming"`) {
			t.Errorf("%s: the relay streamed before it stopped:\n%s", what, harness.LastLines(out, 10))
		}
		if code != 1 {
			t.Errorf("%s: the relay exited %d, want 1", what, code)
		}
		t.Logf("%s: exit %d: %s", what, code, harness.LastLines(out, 1))
	}
	stops("an idle outbox")
	conn := w.connect()
	if err := w.writeTxns(conn, newRand(t), 5, 5, 50); err != nil {
		t.Fatal(err)
	}
	stops("events waiting")
	if n := sumOffsets(endOffsets(t, w.Brokers, w.topics())); n != 0 {
		t.Errorf("the relay published %d records without the registry", n)
	}
	w.Migrate()
	w.startRelay()
	records := w.waitSettled(2 * time.Minute)
	w.checkDelivery(records)
}

// TestDrillPartitionsRegistryLost: outbox_relay_partitions dropped on a
// database whose relay already published (6 partitions recorded), the
// topic raised to 12 meanwhile, migrate run again. Nothing tells the relay
// that keys were mapped by 6: it records 12, as on a first start. It must
// say so, naming the topic and the count it recorded and what to do, and
// count it in outbox_relay_topic_partitions_recorded_over_records_total.
func TestDrillPartitionsRegistryLost(t *testing.T) {
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
	if out := relay.Output(); strings.Contains(out, msgRecordedOverRecords) {
		t.Errorf("the relay warned on its first start over empty topics:\n%s", harness.LastLines(out, 10))
	}
	w.DB.Exec(t, "DROP TABLE outbox_relay_partitions")
	addPartitions(t, w.Brokers, w.topics(), 2*partitions)
	w.Migrate()
	if err := w.writeTxns(conn, rng, 5, 5, 50); err != nil {
		t.Fatal(err)
	}
	relay = w.startRelay("--admin-addr", "127.0.0.1:0")
	admin := relay.AdminURL(t)
	w.waitSettled(2 * time.Minute)
	for _, topic := range w.topics() {
		v, ok := 0.0, false
		waitCond(30*time.Second, func() bool {
			v, ok = harness.MetricValue(harness.Scrape(t, admin), recordedOverRecordsCounter, "topic", topic)
			return ok && v >= 1
		})
		if !ok || v != 1 {
			t.Errorf("%s of %s: %v (exported: %v), want 1", recordedOverRecordsCounter, topic, v, ok)
		}
	}
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("stop the relay: exit %d, %v", code, err)
	}
	out := relay.Output()
	for _, topic := range w.topics() {
		found := false
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, msgRecordedOverRecords) && strings.Contains(line, `"topic":"`+topic+`"`) {
				found = true
				for _, s := range []string{fmt.Sprintf(`"partitions_recorded":%d`, 2*partitions), "outbox-relay partitions show", "partitions adopt --event-topic " + topic + " --partitions N"} {
					if !strings.Contains(line, s) {
						t.Errorf("the warning for %s lacks %q: %s", topic, s, line)
					}
				}
			}
		}
		if !found {
			t.Errorf("the relay did not warn that it recorded the count of %s over its records:\n%s", topic, harness.LastLines(out, 20))
		}
	}
}

// msgRecordedOverRecords is the relay's warning when it records a topic's
// count while the topic already holds records, and
// recordedOverRecordsCounter counts it.
const (
	msgRecordedOverRecords     = "recorded the event topic's partition count, but the topic already holds records"
	recordedOverRecordsCounter = "outbox_relay_topic_partitions_recorded_over_records_total"
)

// TestDrillPartitionsDryRun: after partitions were added, `run --dry-run`
// prints the partition the relay would use, by the count recorded for the
// topic (6), not the topic's count now (12); a topic with no count
// recorded goes by its count now, as the relay's first record would
// record it. The dry run writes nothing to the registry.
func TestDrillPartitionsDryRun(t *testing.T) {
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
	const raised = 2 * partitions
	addPartitions(t, w.Brokers, w.topics(), raised)
	pinned, unrecorded := w.topics()[0], w.topics()[1]
	w.DB.Exec(t, "DELETE FROM outbox_relay_partitions WHERE topic = $1", unrecorded)
	registry := func() string {
		return w.DB.QueryString(t, "SELECT coalesce(string_agg(topic || '=' || partitions || '@' || recorded_at, ',' ORDER BY topic), '') FROM outbox_relay_partitions")
	}
	before := registry()

	dry := harness.StartProcessSplit(t, w.Bin, w.args("run", "--dry-run"), []string{harness.LogLevelInfo})
	dry.WaitForOutput(t, "dry run: printing", time.Minute)
	mark := w.CommittedCount()
	if err := w.writeTxns(conn, rng, 30, 5, 50); err != nil {
		t.Fatal(err)
	}
	want := w.CommittedCount() - mark
	harness.WaitFor(t, time.Minute, "every event printed", func() bool {
		return strings.Count(dry.Stdout(), "\n") >= want || dry.Exited()
	})
	if err := dry.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code, err := dry.Wait(30 * time.Second); err != nil || code != 0 {
		t.Fatalf("the dry run exited %d (%v); logs:\n%s", code, err, harness.LastLines(dry.Output(), 20))
	}
	counts := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(dry.Stdout()), "\n") {
		var r struct {
			Topic          string `json:"topic"`
			Partition      *int32 `json:"partition"`
			PartitionError string `json:"partition_error"`
			Key            string `json:"key"`
		}
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("stdout line is not a record: %q: %v", line, err)
		}
		n := int32(raised)
		if r.Topic == pinned {
			n = partitions
		} else if r.Topic != unrecorded {
			continue
		}
		counts[r.Topic]++
		if r.Partition == nil || *r.Partition != harness.JavaPartition([]byte(r.Key), n) {
			t.Errorf("%s key %s: partition %v (%s), want %d, murmur2 mod %d", r.Topic, r.Key, r.Partition, r.PartitionError, harness.JavaPartition([]byte(r.Key), n), n)
		}
	}
	if counts[pinned] == 0 || counts[unrecorded] == 0 {
		t.Errorf("printed records: %v, want some of %s and of %s", counts, pinned, unrecorded)
	}
	if after := registry(); after != before {
		t.Errorf("the dry run changed the registry:\nbefore %s\nafter  %s", before, after)
	}
	t.Logf("%d records printed: %d of %s by its recorded %d partitions, %d of %s (none recorded) by its %d", want, counts[pinned], pinned, partitions, counts[unrecorded], unrecorded, raised)
}
