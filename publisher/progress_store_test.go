package publisher

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

func startProgressKfake(t *testing.T, opts ...kfake.Opt) (*kfake.Cluster, []string) {
	t.Helper()
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c, c.ListenAddrs()
}

func openProgressStore(t *testing.T, brokers []string, topic string) *ProgressStore {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	s, err := OpenProgress(ctx, brokers, sc, topic)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func latestProgress(t *testing.T, s *ProgressStore, key []byte) (progress.Record, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, ok, err := s.Latest(ctx, key)
	if err != nil {
		t.Fatalf("latest: %v", err)
	}
	return r, ok
}

// TestOpenCreatesCompactedTopic checks the topic the relay creates on a
// broker that would auto-create topics with its defaults (10 partitions,
// delete policy) if a metadata lookup asked it to.
func TestOpenCreatesCompactedTopic(t *testing.T) {
	_, brokers := startProgressKfake(t, kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(10))
	openProgressStore(t, brokers, progress.DefaultTopic)
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	ctx := context.Background()
	details, err := adm.ListTopics(ctx, progress.DefaultTopic)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(details[progress.DefaultTopic].Partitions); n != 1 {
		t.Fatalf("progress topic has %d partitions, want 1", n)
	}
	configs, err := adm.DescribeTopicConfigs(ctx, progress.DefaultTopic)
	if err != nil {
		t.Fatal(err)
	}
	rc, err := configs.On(progress.DefaultTopic, nil)
	if err != nil {
		t.Fatal(err)
	}
	policy := ""
	for _, c := range rc.Configs {
		if c.Key == "cleanup.policy" && c.Value != nil {
			policy = *c.Value
		}
	}
	if policy != "compact" {
		t.Fatalf("cleanup.policy = %q, want compact", policy)
	}
	// Opening again finds the topic and leaves it alone.
	openProgressStore(t, brokers, progress.DefaultTopic)
}

// A store opened once per process outlives a progress topic deleted under
// it (or lost with a broker's data). Reading it then says so, as
// progress.ErrTopicMissing, and Recreate makes it again, once: it reports whether
// it created the topic.
func TestLatestOnADeletedTopicAndRecreate(t *testing.T) {
	_, brokers := startProgressKfake(t)
	s := openProgressStore(t, brokers, "progress")
	key := progress.Key("s", "111")
	if err := s.Write(key, progress.Record{LSN: 100, Timeline: 1}); err != nil {
		t.Fatal(err)
	}
	harness.DeleteTopic(t, brokers, "progress")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, _, err := s.Latest(ctx, key); !errors.Is(err, progress.ErrTopicMissing) {
		t.Fatalf("latest on a deleted topic: want progress.ErrTopicMissing, got %v", err)
	}
	if created, err := s.Recreate(ctx); err != nil || !created {
		t.Fatalf("recreate a deleted topic = %v, %v; want it created", created, err)
	}
	if created, err := s.Recreate(ctx); err != nil || created {
		t.Fatalf("recreate an existing topic = %v, %v; want it left alone", created, err)
	}
	if _, ok := latestProgress(t, s, key); ok {
		t.Fatal("found a record on the new, empty topic")
	}
	if err := s.Write(key, progress.Record{LSN: 200, Timeline: 1}); err != nil {
		t.Fatalf("write to the new topic: %v", err)
	}
	if r, ok := latestProgress(t, s, key); !ok || r.LSN != 200 {
		t.Fatalf("latest on the new topic = %+v, %v; want LSN 200", r, ok)
	}
}

// TestLatestLastRecordOfKeyWins writes records of several keys and checks
// that the newest of each key is found and that another cluster's key
// (same slot, other system identifier) never matches.
func TestLatestLastRecordOfKeyWins(t *testing.T) {
	_, brokers := startProgressKfake(t)
	s := openProgressStore(t, brokers, "progress")
	mine, other := progress.Key("s", "111"), progress.Key("s", "222")
	if _, ok := latestProgress(t, s, mine); ok {
		t.Fatal("found a record on an empty topic")
	}
	for i := 1; i <= 5; i++ {
		if err := s.Write(mine, progress.Record{LSN: lsn.LSN(i * 100), Timeline: 1}); err != nil {
			t.Fatal(err)
		}
		if err := s.Write(other, progress.Record{LSN: lsn.LSN(i * 1000), Timeline: 1}); err != nil {
			t.Fatal(err)
		}
	}
	if r, ok := latestProgress(t, s, mine); !ok || r.LSN != 500 {
		t.Fatalf("latest of mine = %+v, %v; want LSN 500", r, ok)
	}
	if r, ok := latestProgress(t, s, other); !ok || r.LSN != 5000 {
		t.Fatalf("latest of other = %+v, %v; want LSN 5000", r, ok)
	}
	if _, ok := latestProgress(t, s, progress.Key("s", "333")); ok {
		t.Fatal("a third cluster's key matched")
	}
	// A newer relay's record is not guessed at: the caller must decide.
	if _, _, err := s.producer.SendMessage(&sarama.ProducerMessage{Topic: "progress", Partition: 0,
		Key: sarama.ByteEncoder(mine), Value: sarama.StringEncoder(`{"version":2,"lsn":"0/600","timeline":1}`)}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, _, err := s.Latest(ctx, mine); !errors.Is(err, progress.ErrBadRecord) || !errors.Is(err, progress.ErrUnknownVersion) {
		t.Fatalf("a version 2 record: want progress.ErrBadRecord and progress.ErrUnknownVersion, got %v", err)
	}
}

// TestLatestReadCommitted writes progress in Kafka transactions, as the
// exactly-once mode does, with an independent client: a committed record,
// then an aborted one, then one in a transaction left open. Only the
// committed one counts, and the open transaction must not make the read
// wait (it stops at the last stable offset, before commit markers).
func TestLatestReadCommitted(t *testing.T) {
	_, brokers := startProgressKfake(t)
	s := openProgressStore(t, brokers, "progress")
	key := progress.Key("s", "111")
	ctx := context.Background()
	txnWrite := func(id string, r progress.Record, commit kgo.TransactionEndTry) *kgo.Client {
		cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.TransactionalID(id), kgo.DefaultProduceTopic("progress"),
			kgo.RecordPartitioner(kgo.ManualPartitioner()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		if err := cl.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		if err := cl.ProduceSync(ctx, &kgo.Record{Key: key, Value: r.Marshal(), Partition: 0}).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if commit != kgo.TryAbort || id != "open" {
			if err := cl.EndTransaction(ctx, commit); err != nil {
				t.Fatal(err)
			}
		}
		return cl
	}
	txnWrite("committed", progress.Record{LSN: 100, Timeline: 1}, kgo.TryCommit)
	if r, ok := latestProgress(t, s, key); !ok || r.LSN != 100 {
		t.Fatalf("after a committed transaction: %+v, %v", r, ok)
	}
	txnWrite("aborted", progress.Record{LSN: 200, Timeline: 1}, kgo.TryAbort)
	if r, ok := latestProgress(t, s, key); !ok || r.LSN != 100 {
		t.Fatalf("an aborted transaction's record counted: %+v, %v", r, ok)
	}
	if err := s.Write(key, progress.Record{LSN: 150, Timeline: 1}); err != nil {
		t.Fatal(err)
	}
	txnWrite("open", progress.Record{LSN: 300, Timeline: 1}, kgo.TryAbort)
	start := time.Now()
	if r, ok := latestProgress(t, s, key); !ok || r.LSN != 150 {
		t.Fatalf("with a transaction open: %+v, %v; want the plain record at 150", r, ok)
	}
	t.Logf("read with an open transaction took %v", time.Since(start))
}

// TestOpenRefusedCreate: the topic is missing and the broker refuses to
// create it (as for a user without Create). OpenProgress must fail with progress.ErrTopic
// and give the command that creates the topic.
func TestOpenRefusedCreate(t *testing.T) {
	c, brokers := startProgressKfake(t)
	harness.RefuseCreateTopics(c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	_, err := OpenProgress(ctx, brokers, sc, "progress")
	if !errors.Is(err, progress.ErrTopic) {
		t.Fatalf("want progress.ErrTopic, got %v", err)
	}
	want := "kafka-topics.sh --bootstrap-server " + brokers[0] + " --create --topic progress --partitions 1 --replication-factor 1 --config cleanup.policy=compact"
	if !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "kafka-acls.sh") {
		t.Fatalf("error does not give the commands:\n%v\nwant it to contain:\n%s", err, want)
	}
}

// TestWriterAtMostOncePerInterval offers many positions within one interval:
// the first is written at once, the rest wait, and Close writes only the
// newest. The interval is an hour, so any extra write would be a bug, not
// a timing accident.
func TestWriterAtMostOncePerInterval(t *testing.T) {
	_, brokers := startProgressKfake(t)
	s := openProgressStore(t, brokers, "progress")
	key := progress.Key("s", "111")
	written := make(chan progress.Record, 100)
	w := progress.NewWriter(s, time.Hour, zerolog.Nop(), func(r progress.Record) { written <- r })
	w.Offer(key, progress.Record{LSN: 1, Timeline: 1})
	select {
	case r := <-written:
		if r.LSN != 1 {
			t.Fatalf("first write: %+v", r)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the first offer was not written")
	}
	for i := 2; i <= 50; i++ {
		w.Offer(key, progress.Record{LSN: lsn.LSN(i), Timeline: 1})
	}
	w.Close(30 * time.Second)
	// Close returned once the writer's goroutine ended: every record it
	// stored was reported by then.
	close(written)
	var after []lsn.LSN
	for r := range written {
		after = append(after, r.LSN)
	}
	if len(after) != 1 || after[0] != 50 {
		t.Fatalf("after the first write, want only the newest (50) written at Close, got %v", after)
	}
	if r, ok := latestProgress(t, s, key); !ok || r.LSN != 50 {
		t.Fatalf("latest = %+v, %v", r, ok)
	}
	end := progressPartitionEnd(t, brokers, "progress")
	if end != 2 {
		t.Fatalf("%d records on the topic, want 2", end)
	}
}

func progressPartitionEnd(t *testing.T, brokers []string, topic string) int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListEndOffsets(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	o, _ := ends.Lookup(topic, 0)
	return o.Offset
}

// BenchmarkWrite is one progress write acknowledged by an in-process
// broker: the writer does this at most once per --status-interval.
func BenchmarkWrite(b *testing.B) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	s, err := OpenProgress(context.Background(), c.ListenAddrs(), sc, "progress")
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	key := progress.Key("outbox_relay", "7312345678901234567")
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if err := s.Write(key, progress.Record{LSN: lsn.LSN(i), Timeline: 1, CommitTime: time.Now(), RelayVersion: "dev"}); err != nil {
			b.Fatal(err)
		}
	}
}

// TestWriterRetriesAFailedWrite: a write Kafka refuses stays pending and is
// written at the next interval, without a new offer.
func TestWriterRetriesAFailedWrite(t *testing.T) {
	c, brokers := startProgressKfake(t)
	s := openProgressStore(t, brokers, "progress")
	failed := make(chan struct{})
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		produce := req.(*kmsg.ProduceRequest)
		resp := produce.ResponseKind().(*kmsg.ProduceResponse)
		for _, topic := range produce.Topics {
			rt := kmsg.NewProduceResponseTopic()
			rt.Topic = topic.Topic
			for _, p := range topic.Partitions {
				rp := kmsg.NewProduceResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.TopicAuthorizationFailed.Code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		close(failed) // the control is dropped after this one request
		return resp, nil, true
	})
	key := progress.Key("s", "111")
	written := make(chan progress.Record, 100)
	w := progress.NewWriter(s, 50*time.Millisecond, zerolog.Nop(), func(r progress.Record) { written <- r })
	defer w.Close(10 * time.Second)
	w.Offer(key, progress.Record{LSN: 1, Timeline: 1})
	<-failed
	select {
	case r := <-written:
		if r.LSN != 1 {
			t.Fatalf("after the failure the writer wrote %+v, want the pending record (1)", r)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("nothing written after a failed write")
	}
	if r, ok := latestProgress(t, s, key); !ok || r.LSN != 1 {
		t.Fatalf("latest = %+v, %v", r, ok)
	}
}

// TestLatestReadsPastOneRequest: more records than one read request returns
// (12,000 of about 200 bytes against a 1 MiB bound, in several batches),
// so the read must continue from where each answer ended.
func TestLatestReadsPastOneRequest(t *testing.T) {
	_, brokers := startProgressKfake(t)
	s := openProgressStore(t, brokers, "progress")
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic("progress"),
		kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.ProducerBatchMaxBytes(64<<10),
		kgo.ProducerBatchCompression(kgo.NoCompression())) // uncompressed, so the bytes really exceed one read
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	const n = 12000
	records := make([]*kgo.Record, 0, n)
	for i := 1; i <= n; i++ {
		key := progress.Key("s", "other")
		if i%1000 == 0 {
			key = progress.Key("s", "111")
		}
		records = append(records, &kgo.Record{Key: key, Value: progress.Record{LSN: lsn.LSN(i), Timeline: 1, RelayVersion: strings.Repeat("v", 100)}.Marshal(), Partition: 0})
	}
	if err := cl.ProduceSync(context.Background(), records...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if end := progressPartitionEnd(t, brokers, "progress"); end != n {
		t.Fatalf("%d records on the topic, want %d", end, n)
	}
	if r, ok := latestProgress(t, s, progress.Key("s", "111")); !ok || r.LSN != n {
		t.Fatalf("latest = %+v, %v; want LSN %d", r, ok, n)
	}
	if r, ok := latestProgress(t, s, progress.Key("s", "other")); !ok || r.LSN != n-1 {
		t.Fatalf("latest of the other key = %+v, %v; want LSN %d", r, ok, n-1)
	}
}

// A progress writer that gave up waiting for a stalled broker at SIGTERM
// still flushed once more when it stopped, after the relay had closed the
// store: sarama panicked with "send on closed channel" and the relay
// exited 2 about 148 s later (issue 51's hostile review). A write after
// Close is an error now, and Close twice is harmless.
func TestProgressWriteAfterCloseIsAnError(t *testing.T) {
	_, brokers := startProgressKfake(t)
	s := openProgressStore(t, brokers, "progress")
	if err := s.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	err := s.Write([]byte("slot@1"), progress.Record{LSN: 0x100, Timeline: 1})
	if !errors.Is(err, ErrProgressClosed) {
		t.Fatalf("write after close: %v, want ErrProgressClosed", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
}
