package publisher

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// adminWorld is a one-partition topic on kfake, a transactional producer
// and the relay's read client and admin on it, with franz-go as the
// independent client that writes and reads.
type adminWorld struct {
	brokers []string
	topic   string
	txn     *kgo.Client
	client  sarama.Client
	admin   sarama.ClusterAdmin
}

func newAdminWorld(t *testing.T) *adminWorld {
	t.Helper()
	const topic = "outbox.order"
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, topic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	w := &adminWorld{brokers: cluster.ListenAddrs(), topic: topic}
	w.txn, err = kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.TransactionalID("adopt-test"), kgo.DefaultProduceTopic(topic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.txn.Close)
	cfg := DefaultConfig()
	cfg.Brokers = w.brokers
	if w.client, err = NewReadClient(cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.client.Close() })
	if w.admin, err = sarama.NewClusterAdminFromClient(w.client); err != nil {
		t.Fatal(err)
	}
	return w
}

// produce writes n records in one Kafka transaction that ends with commit
// or, with commit false, is aborted.
func (w *adminWorld) produce(t *testing.T, n int, commit bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := w.txn.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if err := w.txn.ProduceSync(ctx, &kgo.Record{Key: fmt.Appendf(nil, "k%d", i), Value: []byte("v")}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.txn.EndTransaction(ctx, kgo.TransactionEndTry(commit)); err != nil {
		t.Fatal(err)
	}
}

// producePlain writes n records outside any transaction.
func (w *adminWorld) producePlain(t *testing.T, n int) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.DefaultProduceTopic(w.topic))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for range n {
		if err := cl.ProduceSync(ctx, &kgo.Record{Key: []byte("plain"), Value: []byte("v")}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
}

// readAndCommit is a consumer group member as the drills' (and many
// services') consumers are: franz-go, read_committed, auto-commit off, and
// CommitUncommittedOffsets after polling. It reads until it has want
// records, then commits, and returns what it committed.
func (w *adminWorld) readAndCommit(t *testing.T, group string, want int) int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup(group), kgo.ConsumeTopics(w.topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.DisableAutoCommit())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got := 0
	for got < want {
		fetches := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("group %s read %d of %d records: %v", group, got, want, err)
		}
		got += fetches.NumRecords()
	}
	if err := cl.CommitUncommittedOffsets(ctx); err != nil {
		t.Fatal(err)
	}
	committed := cl.CommittedOffsets()[w.topic][0].Offset
	cl.LeaveGroup()
	return committed
}

// recordAt is the record at offset, control records included, read
// read_uncommitted.
func (w *adminWorld) recordAt(t *testing.T, offset int64) *kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.KeepControlRecords(),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{w.topic: {0: kgo.NewOffset().At(offset)}}))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		fetches := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("read %s/0 at %d: %v", w.topic, offset, err)
		}
		if recs := fetches.Records(); len(recs) > 0 {
			return recs[0]
		}
	}
}

func (w *adminWorld) behind(t *testing.T, groups ...string) []GroupBehind {
	t.Helper()
	b, err := GroupsBehind(w.client, w.admin, w.topic, groups)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A read_committed group consumer that read every record of a topic an
// exactly-once relay writes commits the offset after its last record. The
// partition's end (the last stable offset, and the high watermark too once
// no transaction is open) is one further: the transaction's commit marker,
// a control record no consumer is handed, takes an offset. Counting the
// group one behind there made partitions adopt refuse for ever. The group
// has read everything; a record written after the marker is what it has
// not read.
func TestGroupsBehindCommitMarker(t *testing.T) {
	w := newAdminWorld(t)
	w.produce(t, 3, true)
	committed := w.readAndCommit(t, "billing", 3)
	end, err := lastStableOffset(w.client, w.topic, 0)
	if err != nil {
		t.Fatal(err)
	}
	// The cause, as the brokers have it: committed 3, end 4, and offset 3
	// is the commit marker.
	if committed != 3 || end != 4 {
		t.Fatalf("committed %d, end %d: want 3 and 4", committed, end)
	}
	if r := w.recordAt(t, committed); !r.Attrs.IsControl() {
		t.Fatalf("the record at the committed offset %d is not a control record: %+v", committed, r)
	}
	if b := w.behind(t, "billing"); len(b) != 0 {
		t.Errorf("a group that read every record counts as behind: %+v", b)
	}

	// A group that never committed is behind, from nothing.
	if b := w.behind(t, "never"); len(b) != 1 || b[0].Committed != -1 || b[0].End != 4 {
		t.Errorf("a group that never committed: %+v, want one partition behind with nothing committed", b)
	}

	// A transaction committed after the group's offset is unread.
	w.produce(t, 2, true)
	if b := w.behind(t, "billing"); len(b) != 1 || b[0].Committed != 3 || b[0].End != 7 {
		t.Errorf("two committed records after the group's offset: %+v, want behind, committed 3, end 7", b)
	}
	// Read them: behind nothing again, past two markers now.
	if c := w.readAndCommit(t, "billing", 2); c != 6 {
		t.Fatalf("committed %d after the second transaction, want 6", c)
	}
	if b := w.behind(t, "billing"); len(b) != 0 {
		t.Errorf("a group that read both transactions counts as behind: %+v", b)
	}

	// An aborted transaction after the group's offset holds nothing a
	// read_committed consumer gets: its records and its abort marker are
	// all skipped.
	w.produce(t, 4, false)
	if b := w.behind(t, "billing"); len(b) != 0 {
		t.Errorf("only an aborted transaction after the group's offset: %+v, want not behind", b)
	}
	// The same producer's next transaction, committed, is unread: the
	// abort marker ended the aborted one.
	w.produce(t, 1, true)
	if b := w.behind(t, "billing"); len(b) != 1 || b[0].Committed != 6 || b[0].End != 14 {
		t.Errorf("a committed transaction after an aborted one: %+v, want behind, committed 6, end 14", b)
	}
	if c := w.readAndCommit(t, "billing", 1); c != 13 {
		t.Fatalf("committed %d after the third committed transaction, want 13", c)
	}
	// A record written outside any transaction is unread too.
	w.producePlain(t, 1)
	if b := w.behind(t, "billing"); len(b) != 1 || b[0].Committed != 13 || b[0].End != 15 {
		t.Errorf("a plain record after the group's offset: %+v, want behind, committed 13, end 15", b)
	}
	if c := w.readAndCommit(t, "billing", 1); c != 15 {
		t.Fatalf("committed %d after the plain record, want 15", c)
	}
	if b := w.behind(t, "billing"); len(b) != 0 {
		t.Errorf("a group at the end: %+v", b)
	}
}
