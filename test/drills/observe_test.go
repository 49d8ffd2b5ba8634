package drills

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// offsets reads partition end offsets with one long-lived client, cheap
// enough to poll.
type offsets struct {
	adm *kadm.Client
}

func newOffsets(t testing.TB, brokers []string) *offsets {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.MetadataMinAge(100*time.Millisecond))
	if err != nil {
		t.Fatalf("offsets client: %v", err)
	}
	t.Cleanup(cl.Close)
	return &offsets{adm: kadm.NewClient(cl)}
}

// read returns the end offset of every partition of topics, keyed
// "topic/partition".
func (o *offsets) read(topics []string) (map[string]int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	listed, err := o.adm.ListEndOffsets(ctx, topics...)
	if err == nil {
		err = listed.Error()
	}
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	listed.Each(func(l kadm.ListedOffset) { out[fmt.Sprintf("%s/%d", l.Topic, l.Partition)] = l.Offset })
	return out, nil
}

// endOffsets is offsets.read with a throwaway client, failing the test on
// error.
func endOffsets(t testing.TB, brokers []string, topics []string) map[string]int64 {
	t.Helper()
	o := newOffsets(t, brokers)
	m, err := o.read(topics)
	if err != nil {
		t.Fatalf("end offsets of %v: %v", topics, err)
	}
	return m
}

func sumOffsets[K comparable](m map[K]int64) int64 {
	var n int64
	for _, v := range m {
		n += v
	}
	return n
}

// requireKafka is harness.RequireApacheKafka with the drill's topics
// created (partitions each, replication factor rf).
func requireKafka(t *testing.T, opts harness.ApacheKafkaOptions, topics []string, rf int16, configs map[string]string) *harness.ApacheKafka {
	t.Helper()
	k := harness.RequireApacheKafka(t, opts)
	for _, topic := range topics {
		if err := k.CreateTopic(topic, partitions, rf, configs); err != nil {
			t.Fatalf("%v%s", err, k.LogTail(0, 30))
		}
	}
	return k
}

// dedicatedKafka starts an Apache Kafka cluster for one test (one that
// stops its broker, which must not disturb the shared ones), with the
// same skip-or-fail rule as harness.RequireApacheKafka.
func dedicatedKafka(t *testing.T, opts harness.ApacheKafkaOptions) *harness.ApacheKafka {
	t.Helper()
	k, err := harness.StartApacheKafka(opts)
	if err != nil {
		if errors.Is(err, harness.ErrApacheKafkaUnavailable) {
			msg := fmt.Sprintf("Apache Kafka could not be started: %v\nfix: run test/kafka/fetch.sh; set %s=1 to make this a failure instead of a skip",
				err, harness.RequireApacheKafkaEnv)
			if os.Getenv(harness.RequireApacheKafkaEnv) == "1" {
				t.Fatal(msg)
			}
			t.Skip("SKIPPING: " + msg)
		}
		t.Fatalf("Apache Kafka could not be started: %v", err)
	}
	t.Cleanup(k.Close)
	return k
}

// lifeStats is what one relay life wrote, from records split by the end
// offsets snapshotted between lives.
type lifeStats struct {
	Records int
	// Unconfirmed counts the events this life delivered that a later life
	// delivered again: delivered, but not confirmed to PostgreSQL when the
	// life was killed. That is the duplicates this life's crash caused,
	// each counted once, at the life that wrote the copy the next one
	// repeats.
	Unconfirmed int
	// RepeatedSelf counts records repeating an event this same life had
	// already delivered (retries gone wrong; zero in a clean life).
	RepeatedSelf int
}

func splitLives(records []harness.Record, snapshots []map[string]int64) []lifeStats {
	lives := make([]lifeStats, len(snapshots)+1)
	lifeOf := func(r harness.Record) int {
		tp := fmt.Sprintf("%s/%d", r.Topic, r.Partition)
		for i, s := range snapshots {
			if r.Offset < s[tp] {
				return i
			}
		}
		return len(snapshots)
	}
	in := map[string][]int{} // event id -> lives that delivered it, with repeats
	for _, r := range records {
		in[r.EventID()] = append(in[r.EventID()], lifeOf(r))
	}
	for _, ls := range in {
		sort.Ints(ls)
		var distinct []int
		for i, l := range ls {
			lives[l].Records++
			if i > 0 && ls[i-1] == l {
				lives[l].RepeatedSelf++
				continue
			}
			distinct = append(distinct, l)
		}
		for _, l := range distinct[:len(distinct)-1] {
			lives[l].Unconfirmed++
		}
	}
	return lives
}

// waitStableOffsets waits until the end offsets of topics stop moving
// (unchanged over several polls) and returns them: after a SIGKILL, a
// produce request the broker had already read may still be appended.
func waitStableOffsets(t *testing.T, o *offsets, topics []string) map[string]int64 {
	t.Helper()
	var last map[string]int64
	same := 0
	harness.WaitFor(t, time.Minute, "end offsets stop moving", func() bool {
		m, err := o.read(topics)
		if err != nil {
			same = 0
			return false
		}
		if last != nil && equalOffsets(m, last) {
			same++
		} else {
			same = 0
		}
		last = m
		return same >= 10 // ~200 ms unchanged
	})
	return last
}

func equalOffsets(a, b map[string]int64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// onPartitions maps each aggregate to the "topic/partition" its events went
// to, from first deliveries.
func onPartitions(records []harness.Record) map[string]string {
	out := map[string]string{}
	for _, r := range harness.FirstDeliveries(records) {
		out[string(r.Key)] = fmt.Sprintf("%s/%d", r.Topic, r.Partition)
	}
	return out
}

// restartReasons lists the distinct errors the relay gave for restarting
// its stream, each cut to 160 characters.
func restartReasons(out string) []string {
	seen := map[string]bool{}
	var reasons []string
	for _, l := range harness.LogLines(out) {
		if !strings.Contains(l.Str("message"), msgRestart) {
			continue
		}
		r := l.Str("error")
		if len(r) > 160 {
			r = r[:160] + "..."
		}
		if !seen[r] {
			seen[r] = true
			reasons = append(reasons, r)
		}
	}
	return reasons
}
