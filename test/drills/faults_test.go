package drills

import (
	mrand "math/rand/v2"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// kfakeWorld is a drill's world on the shared PostgreSQL and its own kfake,
// migrated, with the topics created.
func kfakeWorld(t *testing.T, opts harness.KfakeOptions) (*world, *harness.Kfake) {
	t.Helper()
	w := newWorld(t, shared, nil)
	k := startKfake(t, opts, w.topics())
	w.Brokers = k.Brokers()
	w.Migrate()
	return w, k
}

func writerRand(rng *mrand.Rand) *mrand.Rand {
	return mrand.New(mrand.NewPCG(rng.Uint64(), rng.Uint64()))
}

// TestDrillAckLostAfterAppend: the broker appends a batch and then the
// acknowledgement is lost (REQUEST_TIMED_OUT after the append, as when
// replication times out). The producer retries the same batch. With
// sarama's idempotent producer the retry carries the same producer id,
// epoch and sequence numbers, and kfake (like a real broker) answers it as
// a duplicate without appending it again: no loss and zero duplicates.
// This pins idempotence being on and surviving retries (a relay with
// Idempotent=false, or one that restarts its session on a retriable error,
// writes the batch twice).
func TestDrillAckLostAfterAppend(t *testing.T) {
	rng := newRand(t)
	w, k := kfakeWorld(t, harness.KfakeOptions{})
	conn := w.connect()
	relay := w.startRelay()
	if err := w.writeTxns(conn, rng, 10, 5, 50); err != nil {
		t.Fatal(err)
	}
	w.consumeAll(time.Minute) // topics known, producer id assigned

	const faults = 5
	f := k.FailProduceAfterAppend(faults)
	wrng := writerRand(rng)
	wait := runWriter(func() error { return w.writeTxns(conn, wrng, 300, 10, 200) })
	harness.WaitFor(t, 2*time.Minute, "the broker to lose 5 acks after appending", func() bool { return f.Hits() >= faults })
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	if dups := harness.Duplicates(records); len(dups) > 0 {
		t.Errorf("%d events delivered more than once after lost acks; the idempotent producer's retry of an appended batch "+
			"must be deduplicated by the broker (same producer id, epoch and sequence), so a duplicate means the batch was "+
			"re-sent as new records: a new producer (a stream restart) or broken sequence numbers", len(dups))
	}
	if n := strings.Count(relay.Output(), msgRestart); n > 0 {
		t.Errorf("relay restarted its stream %d times for a retriable error it should have retried in place", n)
	}
	t.Logf("%d acks lost after append; %d records for %d events, %d duplicates", f.Hits(), len(records), w.CommittedCount(), len(records)-w.CommittedCount())
}

// TestDrillRetriableBrokerErrors injects NOT_LEADER_OR_FOLLOWER,
// NOT_ENOUGH_REPLICAS and REQUEST_TIMED_OUT into produce responses: first
// a few at a time, which sarama must retry in place (sarama #2619 and
// #2860: reordering on retry), then a run of consecutive failures longer
// than the relay's retry budget (--kafka-retry-max 3), which makes the
// relay restart its stream from the slot. Expect no loss, no reordering
// within any partition, the process never exiting, and the slot never
// confirming the failing events while the errors last.
func TestDrillRetriableBrokerErrors(t *testing.T) {
	rng := newRand(t)
	w, k := kfakeWorld(t, harness.KfakeOptions{})
	conn := w.connect()
	relay := w.startRelay("--kafka-retry-max", "3")
	if err := w.writeTxns(conn, rng, 10, 5, 100); err != nil {
		t.Fatal(err)
	}
	w.consumeAll(time.Minute)

	// Within the retry budget: sarama retries, the stream goes on.
	for _, c := range []struct {
		name string
		code int16
	}{
		{"NOT_LEADER_OR_FOLLOWER", kerr.NotLeaderForPartition.Code},
		{"NOT_ENOUGH_REPLICAS", kerr.NotEnoughReplicas.Code},
		{"REQUEST_TIMED_OUT", kerr.RequestTimedOut.Code},
	} {
		f := k.FailProduce(2, c.code)
		wrng := writerRand(rng)
		wait := runWriter(func() error { return w.writeTxns(conn, wrng, 100, 10, 100) })
		harness.WaitFor(t, 2*time.Minute, c.name+" injected twice", func() bool { return f.Hits() >= 2 })
		if err := wait(); err != nil {
			t.Fatal(err)
		}
		w.consumeAll(2 * time.Minute)
	}
	if n := strings.Count(relay.Output(), msgRestart); n > 0 {
		t.Errorf("relay restarted its stream %d times for errors within its retry budget (2 failures, --kafka-retry-max 3)", n)
	}

	// Longer than any retry budget: every produce request fails until
	// removed. The first failing transaction is the fence the slot must not
	// pass while the errors last.
	restarts := strings.Count(relay.Output(), msgRestart)
	f := k.FailProduce(-1, kerr.NotLeaderForPartition.Code)
	fence := w.fence(conn, w.genEvents(rng, 10, 100))
	wrng := writerRand(rng)
	wait := runWriter(func() error { return w.writeTxns(conn, wrng, 100, 10, 100) })
	began := time.Now()
	var passed string
	harness.WaitFor(t, 3*time.Minute, "20 consecutive failed produce requests and two stream restarts", func() bool {
		if c := w.ConfirmedFlush(); !notPast(c, fence) {
			passed = c
			return true
		}
		return relay.Exited() || f.Hits() >= 20 && strings.Count(relay.Output(), msgRestart) >= restarts+2
	})
	if passed != "" {
		t.Fatalf("confirmed_flush_lsn %s passed the failing transaction (commit at %s) while produce requests failed", passed, fence)
	}
	if relay.Exited() {
		t.Fatalf("relay exited while the broker returned retriable errors:\n%s", relay.Output())
	}
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	if c := w.ConfirmedFlush(); !notPast(c, fence) {
		t.Fatalf("confirmed_flush_lsn %s passed the failing transaction (commit at %s) while produce requests failed", c, fence)
	}
	f.Remove()
	t.Logf("%d consecutive produce requests failed over %v; %d stream restarts meanwhile",
		f.Hits(), time.Since(began).Round(time.Millisecond), strings.Count(relay.Output(), msgRestart)-restarts)

	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	t.Logf("%d records for %d events", len(records), w.CommittedCount())
}

// TestDrillSequenceAndEpochErrors answers one produce request with
// OUT_OF_ORDER_SEQUENCE_NUMBER or INVALID_PRODUCER_EPOCH: the producer's
// idempotence state is broken (sarama #1430, #1661, #2611, #2803), so the
// relay must throw the producer away, re-stream from the confirmed LSN and
// lose nothing. sarama may meanwhile have appended later batches of the
// failed partitions, so order there may break; the relay must say so, in
// its log and in outbox_relay_order_breaks_total, naming the partition.
// Every other partition keeps commit order.
func TestDrillSequenceAndEpochErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		code int16
	}{
		{"OUT_OF_ORDER_SEQUENCE_NUMBER", kerr.OutOfOrderSequenceNumber.Code},
		{"INVALID_PRODUCER_EPOCH", kerr.InvalidProducerEpoch.Code},
	} {
		t.Run(c.name, func(t *testing.T) { sequenceDrill(t, c.code) })
	}
}

func sequenceDrill(t *testing.T, code int16) {
	rng := newRand(t)
	w, k := kfakeWorld(t, harness.KfakeOptions{})
	conn := w.connect()
	relay := w.startRelay("--admin-addr", "127.0.0.1:0")
	if err := w.writeTxns(conn, rng, 10, 5, 300); err != nil {
		t.Fatal(err)
	}
	w.consumeAll(time.Minute)

	wrng := writerRand(rng)
	wait := runWriter(func() error { return w.writeTxns(conn, wrng, 500, 10, 300) })
	// Inject once the stream is busy, so the failed request carries a batch
	// with later ones queued behind it.
	harness.WaitFor(t, time.Minute, "writer under way", func() bool { return w.CommittedCount() > 1000 })
	// Only the event topics: a fault that hit the progress writer's request
	// instead left the event producer untouched, and the drill failed by
	// chance.
	f := k.FailProduceTo(w.topicPrefix, 1, code)
	harness.WaitFor(t, time.Minute, "the fault to hit a produce request of the event topics", func() bool { return f.Hits() >= 1 })
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(3 * time.Minute)
	ids, order := w.Committed()
	harness.CheckNoLoss(t, records, ids)

	// The partitions the relay says may be out of order.
	out := relay.Output()
	flagged := map[string]bool{}
	for _, l := range harness.LogLines(out) {
		if strings.Contains(l.Str("message"), msgOrder) {
			if l.Str("topic") == "" || l.Str("partition") == "" {
				t.Errorf("order warning does not name topic and partition: %v", l)
				continue
			}
			flagged[l.Str("topic")+"/"+l.Str("partition")] = true
		}
	}
	if len(flagged) == 0 {
		t.Fatalf("relay did not log %q after a produce request failed with error code %d; output:\n%s", msgOrder, code, out)
	}
	if !strings.Contains(out, msgRestart) {
		t.Errorf("relay did not restart its stream (and producer) after error code %d", code)
	}

	// Order must hold everywhere else.
	broken := checkPartitionOrder(t, records, w.CommitIndex(), flagged)
	where := onPartitions(records)
	kept := map[string][]string{}
	for agg, evs := range order {
		if !flagged[where[agg]] {
			kept[agg] = evs
		}
	}
	harness.CheckPerAggregateOrder(t, records, kept)

	// And the counter says the same.
	families := harness.Scrape(t, relay.AdminURL(t))
	var names []string
	for tp := range flagged {
		names = append(names, tp)
		topic, p, _ := strings.Cut(tp, "/")
		if v, _ := harness.MetricValue(families, "outbox_relay_order_breaks_total", "topic", topic, "partition", p); v < 1 {
			t.Errorf("outbox_relay_order_breaks_total{partition=%q,topic=%q} = %v, want >= 1; series: %v",
				p, topic, v, families["outbox_relay_order_breaks_total"].GetMetric())
		}
	}
	sort.Strings(names)
	t.Logf("flagged partitions %v (order actually broken in %d of them: %v); %d aggregates on other partitions kept order; %d records for %d events",
		names, len(broken), broken, len(kept), len(records), len(ids))
}
