package harness

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// This file is the harness's independent view of Kafka. It uses franz-go,
// never sarama: the relay publishes with sarama, and a test must not let the
// code under test judge itself.

// EventIDHeader is the record header carrying the outbox event id.
const EventIDHeader = "event_id"

// Record is a consumed Kafka record.
type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	// Headers maps header keys to values; with repeated keys the last
	// value wins. HeaderKeys lists every key in wire order.
	Headers    map[string]string
	HeaderKeys []string
	// HeaderValues are the header values in wire order; nil is a null
	// value, which Headers shows as "".
	HeaderValues [][]byte
	Timestamp    time.Time
}

// EventID is the record's event_id header, "" if it has none.
func (r Record) EventID() string { return r.Headers[EventIDHeader] }

// pos is "topic/partition@offset", for messages.
func (r Record) pos() string { return fmt.Sprintf("%s/%d@%d", r.Topic, r.Partition, r.Offset) }

// NewKgoClient returns a franz-go client for brokers, closed when the test
// ends.
func NewKgoClient(t testing.TB, brokers []string, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...)}, opts...)...)
	if err != nil {
		t.Fatalf("kafka client: %v", err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// adminClient is a short-lived admin client; the caller closes it.
func adminClient(t testing.TB, brokers []string) (*kadm.Client, func()) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatalf("kafka admin client: %v", err)
	}
	return kadm.NewClient(cl), cl.Close
}

// CreateTopic creates a topic with replication factor 1 through the Kafka
// admin API; configs are topic configs such as max.message.bytes.
func CreateTopic(t testing.TB, brokers []string, name string, partitions int32, configs map[string]string) {
	t.Helper()
	adm, closeAdm := adminClient(t, brokers)
	defer closeAdm()
	cfg := make(map[string]*string, len(configs))
	for k, v := range configs {
		cfg[k] = &v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := adm.CreateTopic(ctx, partitions, 1, cfg, name)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatalf("create topic %s: %v %s", name, err, resp.ErrMessage)
	}
}

// DeleteTopic deletes a topic through the Kafka admin API.
func DeleteTopic(t testing.TB, brokers []string, name string) {
	t.Helper()
	adm, closeAdm := adminClient(t, brokers)
	defer closeAdm()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := adm.DeleteTopic(ctx, name)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatalf("delete topic %s: %v %s", name, err, resp.ErrMessage)
	}
}

// EndOffsets returns the high watermark of every partition of topic.
func EndOffsets(t testing.TB, brokers []string, topic string) map[int32]int64 {
	t.Helper()
	adm, closeAdm := adminClient(t, brokers)
	defer closeAdm()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	listed, err := adm.ListEndOffsets(ctx, topic)
	if err == nil {
		err = listed.Error()
	}
	if err != nil {
		t.Fatalf("end offsets of %s: %v", topic, err)
	}
	out := make(map[int32]int64)
	listed.Each(func(o kadm.ListedOffset) { out[o.Partition] = o.Offset })
	return out
}

// CommittedOffsets returns the offsets consumer group has committed for
// topic, by partition (absent: nothing committed), as the group
// coordinator reports them. A group the coordinator does not know yet has
// committed nothing.
func CommittedOffsets(t testing.TB, brokers []string, group, topic string) map[int32]int64 {
	t.Helper()
	adm, closeAdm := adminClient(t, brokers)
	defer closeAdm()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fetched, err := adm.FetchOffsetsForTopics(ctx, group, topic)
	if err == nil {
		err = fetched.Error()
	}
	if errors.Is(err, kerr.GroupIDNotFound) {
		return map[int32]int64{}
	}
	if err != nil {
		t.Fatalf("committed offsets of group %s: %v", group, err)
	}
	out := make(map[int32]int64)
	fetched.Each(func(o kadm.OffsetResponse) {
		if o.At >= 0 {
			out[o.Partition] = o.At
		}
	})
	return out
}

// TopicRecords says whether topic exists and how many records its
// partitions hold (end minus start offsets), for a test that must show
// nothing was written to a topic.
func TopicRecords(t testing.TB, brokers []string, topic string) (exists bool, records int64) {
	t.Helper()
	adm, closeAdm := adminClient(t, brokers)
	defer closeAdm()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	topics, err := adm.ListTopics(ctx, topic)
	if err != nil {
		t.Fatalf("list topic %s: %v", topic, err)
	}
	if !topics.Has(topic) {
		return false, 0
	}
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		t.Fatalf("end offsets of %s: %v", topic, err)
	}
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err == nil {
		err = starts.Error()
	}
	if err != nil {
		t.Fatalf("start offsets of %s: %v", topic, err)
	}
	ends.Each(func(o kadm.ListedOffset) {
		start, _ := starts.Lookup(topic, o.Partition)
		records += o.Offset - start.Offset
	})
	return true, records
}

// ConsumeUntil reads every topic matching topicRegex from the beginning
// (read_committed, so aborted transactional records are not seen) until
// done returns true for everything read so far, and returns those records.
// Topics created while it runs are picked up within a fraction of a second.
// The regex is unanchored, as in Kafka; internal topics (__*) are skipped.
// At timeout it fails the test, saying what it did read.
//
// done is called with the growing slice after every fetch and must not keep
// it. ConsumeUntil calls t.Fatalf, so use it from the test's goroutine.
func ConsumeUntil(t testing.TB, brokers []string, topicRegex string, timeout time.Duration, done func(all []Record) bool) []Record {
	t.Helper()
	return consume(t, brokers, nil, topicRegex, timeout, done, nil)
}

// ConsumeEventIDs is ConsumeUntil until every event id in want has been
// seen at least once; on timeout it names the missing ones.
func ConsumeEventIDs(t testing.TB, brokers []string, topicRegex string, want []string, timeout time.Duration) []Record {
	t.Helper()
	return ConsumeEventIDsWith(t, brokers, nil, topicRegex, want, timeout)
}

// ConsumeEventIDsWith is ConsumeEventIDs with further franz-go client
// options, applied last: TLS or SASL for a broker that requires them.
func ConsumeEventIDsWith(t testing.TB, brokers []string, clientOpts []kgo.Opt, topicRegex string, want []string, timeout time.Duration) []Record {
	t.Helper()
	missing := make(map[string]bool, len(want))
	for _, id := range want {
		missing[id] = true
	}
	seen := 0
	done := func(all []Record) bool {
		for _, r := range all[seen:] {
			delete(missing, r.EventID())
		}
		seen = len(all)
		return len(missing) == 0
	}
	describe := func([]Record) string {
		return fmt.Sprintf("%d of %d wanted event ids missing: %s", len(missing), len(want), sampleIDs(missing, 20))
	}
	return consume(t, brokers, clientOpts, topicRegex, timeout, done, describe)
}

// ConsumeToEnd reads topic from the start up to the end offsets it has
// when the call begins, and returns every record. It is for topics written
// without transactions: a commit marker at a partition's end is never
// returned as a record, so such a partition would not be read to its end.
func ConsumeToEnd(t testing.TB, brokers []string, topic string, timeout time.Duration) []Record {
	t.Helper()
	ends := EndOffsets(t, brokers, topic)
	next := make(map[int32]int64, len(ends))
	seen := 0
	done := func(all []Record) bool {
		for _, r := range all[seen:] {
			next[r.Partition] = max(next[r.Partition], r.Offset+1)
		}
		seen = len(all)
		for p, end := range ends {
			if next[p] < end {
				return false
			}
		}
		return true
	}
	return ConsumeUntil(t, brokers, "^"+regexp.QuoteMeta(topic)+"$", timeout, done)
}

func consume(t testing.TB, brokers []string, clientOpts []kgo.Opt, topicRegex string, timeout time.Duration,
	done func([]Record) bool, describe func([]Record) string) []Record {
	t.Helper()
	var all []Record
	if done(all) {
		return all
	}
	cl, err := kgo.NewClient(append([]kgo.Opt{
		kgo.SeedBrokers(brokers...),
		kgo.ConsumeRegex(),
		kgo.ConsumeTopics(topicRegex),
		kgo.ConsumeExcludeTopics("^__"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		// New topics appear only through a metadata refresh.
		kgo.MetadataMinAge(50 * time.Millisecond),
		kgo.MetadataMaxAge(250 * time.Millisecond),
		kgo.FetchMaxWait(200 * time.Millisecond),
	}, clientOpts...)...)
	if err != nil {
		t.Fatalf("consume %q: new client: %v", topicRegex, err)
	}
	defer cl.Close()

	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	lastErrs := map[string]string{}
	for {
		fetches := cl.PollFetches(ctx)
		fetches.EachError(func(topic string, p int32, err error) {
			if ctx.Err() == nil {
				lastErrs[fmt.Sprintf("%s/%d", topic, p)] = err.Error()
			}
		})
		fetches.EachRecord(func(r *kgo.Record) { all = append(all, fromKgo(r)) })
		if done(all) {
			return all
		}
		if ctx.Err() != nil {
			break
		}
	}
	msg := fmt.Sprintf("consume %q from %v: timed out after %v with %d records (%s)",
		topicRegex, brokers, timeout, len(all), partitionCounts(all))
	if describe != nil {
		msg += "; " + describe(all)
	}
	if len(lastErrs) > 0 {
		msg += fmt.Sprintf("; fetch errors: %v", lastErrs)
	}
	t.Fatal(msg)
	return nil
}

func fromKgo(r *kgo.Record) Record {
	out := Record{
		Topic:     r.Topic,
		Partition: r.Partition,
		Offset:    r.Offset,
		Key:       r.Key,
		Value:     r.Value,
		Headers:   make(map[string]string, len(r.Headers)),
		Timestamp: r.Timestamp,
	}
	for _, h := range r.Headers {
		out.Headers[h.Key] = string(h.Value)
		out.HeaderKeys = append(out.HeaderKeys, h.Key)
		out.HeaderValues = append(out.HeaderValues, h.Value)
	}
	return out
}

// partitionCounts summarises records as "topic/partition=count ...".
func partitionCounts(all []Record) string {
	if len(all) == 0 {
		return "none"
	}
	counts := map[string]int{}
	for _, r := range all {
		counts[fmt.Sprintf("%s/%d", r.Topic, r.Partition)]++
	}
	keys := make([]string, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, counts[k])
	}
	return strings.Join(parts, " ")
}

func sampleIDs(ids map[string]bool, limit int) string {
	s := make([]string, 0, len(ids))
	for id := range ids {
		s = append(s, id)
	}
	sort.Strings(s)
	if len(s) > limit {
		return strings.Join(s[:limit], ", ") + fmt.Sprintf(", ... (%d more)", len(s)-limit)
	}
	return strings.Join(s, ", ")
}

// JavaPartition is the partition Kafka's Java producer's default
// partitioner picks for key among numPartitions: murmur2 of the key, sign
// bit cleared, modulo the count. It delegates to franz-go's
// StickyKeyPartitioner with its Kafka-compatible hasher, so it is
// independent of the relay's own partitioner. A nil key has no fixed
// partition (the Java client spreads such records), so it returns -1, as
// it does for numPartitions <= 0; an empty non-nil key is hashed.
func JavaPartition(key []byte, numPartitions int32) int32 {
	if key == nil || numPartitions <= 0 {
		return -1
	}
	p := kgo.StickyKeyPartitioner(nil).ForTopic("")
	return int32(p.Partition(&kgo.Record{Key: key}, int(numPartitions)))
}

// FirstDeliveries keeps the first occurrence of each event id, scanning the
// records in (topic, partition, offset) order, which is also the order of
// the result; a redelivery later in a partition is dropped. Records without
// an event_id header cannot be redeliveries of anything and are all kept.
func FirstDeliveries(records []Record) []Record {
	sorted := append([]Record(nil), records...)
	sort.SliceStable(sorted, func(i, j int) bool {
		a, b := sorted[i], sorted[j]
		if a.Topic != b.Topic {
			return a.Topic < b.Topic
		}
		if a.Partition != b.Partition {
			return a.Partition < b.Partition
		}
		return a.Offset < b.Offset
	})
	seen := make(map[string]bool)
	out := sorted[:0]
	for _, r := range sorted {
		id := r.EventID()
		if id != "" {
			if seen[id] {
				continue
			}
			seen[id] = true
		}
		out = append(out, r)
	}
	return out
}

// Duplicates returns the event ids delivered more than once, with their
// delivery counts.
func Duplicates(records []Record) map[string]int {
	counts := make(map[string]int)
	for _, r := range records {
		if id := r.EventID(); id != "" {
			counts[id]++
		}
	}
	for id, n := range counts {
		if n < 2 {
			delete(counts, id)
		}
	}
	return counts
}

// CheckPerAggregateOrder checks, for every aggregate in commitOrder
// (aggregate id to its event ids in commit order), that its events' first
// deliveries all went to one partition of one topic and sit at increasing
// offsets in commit order, i.e. a consumer that skips redeliveries sees
// them in commit order. An event that was never delivered is an error too.
// It reports every aggregate's first violation with t.Errorf.
func CheckPerAggregateOrder(t testing.TB, records []Record, commitOrder map[string][]string) {
	t.Helper()
	first := make(map[string]Record)
	for _, r := range FirstDeliveries(records) {
		if id := r.EventID(); id != "" {
			first[id] = r
		}
	}
	aggs := make([]string, 0, len(commitOrder))
	for a := range commitOrder {
		aggs = append(aggs, a)
	}
	sort.Strings(aggs)
	for _, agg := range aggs {
		var prev Record
		prevID, prevIdx := "", 0
		for i, id := range commitOrder[agg] {
			r, ok := first[id]
			if !ok {
				t.Errorf("aggregate %s: event %s (#%d in commit order) was never delivered", agg, id, i+1)
				continue
			}
			if prevID == "" {
				prev, prevID, prevIdx = r, id, i
				continue
			}
			if r.Topic != prev.Topic || r.Partition != prev.Partition {
				t.Errorf("aggregate %s: event %s (#%d) went to %s but event %s (#%d) to %s; one aggregate must stay on one partition",
					agg, id, i+1, r.pos(), prevID, prevIdx+1, prev.pos())
				break
			}
			if r.Offset < prev.Offset {
				t.Errorf("aggregate %s: event %s (#%d in commit order) was first delivered at %s, before event %s (#%d) at %s",
					agg, id, i+1, r.pos(), prevID, prevIdx+1, prev.pos())
				break
			}
			prev, prevID, prevIdx = r, id, i
		}
	}
}

// CheckNoLoss checks that every event id in want was delivered at least
// once, reporting the missing ones with t.Errorf.
func CheckNoLoss(t testing.TB, records []Record, want []string) {
	t.Helper()
	got := make(map[string]bool, len(records))
	for _, r := range records {
		got[r.EventID()] = true
	}
	missing := make(map[string]bool)
	for _, id := range want {
		if !got[id] {
			missing[id] = true
		}
	}
	if len(missing) > 0 {
		t.Errorf("lost %d of %d events: %s", len(missing), len(want), sampleIDs(missing, 20))
	}
}

// SameInstant reports whether two RFC 3339 times are the same instant, so
// header times that differ only in trailing zeros of the fraction compare
// equal.
func SameInstant(a, b string) bool {
	ta, err1 := time.Parse(time.RFC3339Nano, a)
	tb, err2 := time.Parse(time.RFC3339Nano, b)
	return err1 == nil && err2 == nil && ta.Equal(tb)
}
