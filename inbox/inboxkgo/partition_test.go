package inboxkgo_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/inbox/inboxkgo"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

const topic = "outbox.event.account"

// consumerDB is a database of the test's own with the inbox's tables and
// an effects table, and a pool on it for the consumer.
func consumerDB(t *testing.T) (*harness.PGDatabase, *pgxpool.Pool) {
	t.Helper()
	db := shared.Get(t).CreateTestDatabase(t)
	ddl, err := inbox.SQL(inbox.Tables{})
	if err != nil {
		t.Fatal(err)
	}
	db.Exec(t, ddl)
	db.Exec(t, `CREATE TABLE effects (seq bigserial PRIMARY KEY, event_id text NOT NULL, partition int NOT NULL)`)
	pool, err := pgxpool.New(context.Background(), db.DSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return db, pool
}

func record(id, aggregate string, partition int32) *kgo.Record {
	return &kgo.Record{Topic: topic, Partition: partition, Key: []byte(aggregate), Value: []byte(`{}`), Headers: []kgo.RecordHeader{
		{Key: "event_id", Value: []byte(id)}, {Key: "aggregate_type", Value: []byte("account")},
		{Key: "aggregate_id", Value: []byte(aggregate)}, {Key: "event_type", Value: []byte("Credited")},
	}}
}

func produce(t *testing.T, cl *kgo.Client, recs ...*kgo.Record) {
	t.Helper()
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// recordEffect writes one row per application, with the record's
// partition, which the aggregate names ("p2-..." lives on partition 2).
func recordEffect(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
	var partition int
	if _, err := fmt.Sscanf(ev.AggregateID, "p%d-", &partition); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, partition) VALUES ($1, $2)`, ev.ID, partition)
	return err
}

// running runs c until the test ends. stop ends Run and returns its error;
// ended is closed when Run returns, by itself or after stop.
func running(t *testing.T, c *inboxkgo.Consumer) (stop func() error, ended <-chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var err error
	go func() {
		defer close(done)
		err = c.Run(ctx)
	}()
	stop = func() error {
		cancel()
		select {
		case <-done:
			return err
		case <-time.After(time.Minute):
			return errors.New("Run did not return within a minute of its context's end")
		}
	}
	t.Cleanup(func() { _ = stop() })
	return stop, done
}

// A record that keeps failing holds its own partition only: while the
// handler fails for one aggregate on partition 2, records produced
// afterwards to partitions 0, 1 and 3 are applied, and partition 2's record
// behind the failing one is not. Once the handler succeeds, partition 2
// goes on in order. Waiting for every partition of a poll before the next
// one stalled the whole member here.
func TestFailingPartitionHoldsOnlyItself(t *testing.T) {
	db, pool := consumerDB(t)
	k := harness.StartKfake(t)
	k.CreateTopic(t, topic, 4, nil)
	producer := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	produce(t, producer, record("stuck", "p2-stuck", 2), record("behind", "p2-other", 2))

	cl := harness.NewKgoClient(t, k.Brokers(), kgo.ConsumerGroup("billing"), kgo.ConsumeTopics(topic),
		kgo.AutoCommitMarks(), kgo.BlockRebalanceOnPoll(), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ib, err := inbox.New(inbox.Config{Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	var failing atomic.Bool
	var failures atomic.Int64
	failing.Store(true)
	c := &inboxkgo.Consumer{Client: cl, Inbox: ib, DB: pool, CommitEach: true, RetryMax: 50 * time.Millisecond,
		Handler: func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
			if ev.ID == "stuck" && failing.Load() {
				return errors.New("downstream refuses this aggregate")
			}
			return recordEffect(ctx, tx, ev)
		},
		OnError: func(*kgo.Record, error) { failures.Add(1) },
	}
	stop, ended := running(t, c)
	harness.WaitFor(t, 30*time.Second, "the stuck record fails", func() bool { return failures.Load() > 0 })

	var others []*kgo.Record
	for _, p := range []int32{0, 1, 3} {
		for i := range 3 {
			others = append(others, record(fmt.Sprintf("p%d-e%d", p, i), fmt.Sprintf("p%d-a%d", p, i), p))
		}
	}
	produce(t, producer, others...)
	harness.WaitFor(t, 30*time.Second, "partitions 0, 1 and 3 are applied while partition 2 fails", func() bool {
		return db.QueryInt64(t, `SELECT count(*) FROM effects WHERE partition <> 2`) == int64(len(others))
	})
	harness.WaitFor(t, 30*time.Second, "the offsets of partitions 0, 1 and 3 are committed while partition 2 fails", func() bool {
		offsets := harness.CommittedOffsets(t, k.Brokers(), "billing", topic)
		return offsets[0] == 3 && offsets[1] == 3 && offsets[3] == 3
	})
	before := failures.Load()
	harness.WaitFor(t, 30*time.Second, "the stuck record is still being retried", func() bool { return failures.Load() > before })
	if o, ok := harness.CommittedOffsets(t, k.Brokers(), "billing", topic)[2]; ok && o > 0 {
		t.Fatalf("partition 2's offset committed at %d while its first record fails", o)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM effects WHERE partition = 2`); n != 0 {
		t.Fatalf("%d records of partition 2 applied while its first record fails", n)
	}
	select {
	case <-ended:
		t.Fatalf("Run returned while a record was retried: %v", stop())
	default:
	}

	failing.Store(false)
	harness.WaitFor(t, 30*time.Second, "partition 2 is applied once its record succeeds", func() bool {
		return db.QueryInt64(t, `SELECT count(*) FROM effects WHERE partition = 2`) == 2
	})
	if got := db.QueryString(t, `SELECT string_agg(event_id, ',' ORDER BY seq) FROM effects WHERE partition = 2`); got != "stuck,behind" {
		t.Errorf("partition 2 applied as %q, want stuck,behind", got)
	}
	harness.WaitFor(t, 30*time.Second, "every offset is committed", func() bool {
		offsets := harness.CommittedOffsets(t, k.Brokers(), "billing", topic)
		return offsets[0] == 3 && offsets[1] == 3 && offsets[2] == 2 && offsets[3] == 3
	})
	if err := stop(); err != nil {
		t.Errorf("run: %v", err)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM effects`); n != int64(len(others))+2 {
		t.Errorf("%d effects for %d records", n, len(others)+2)
	}
}

// Run rides out a broker outage: with the only broker down (connections
// refused), the client's errors go to OnClientError and Run keeps going;
// once the broker is back on the same port, with its data, records
// produced then are applied. Run used to return the first of those errors
// ("unable to join group session: ... connection refused").
func TestRunRidesOutABrokerOutage(t *testing.T) {
	db, pool := consumerDB(t)
	port, dir := harness.FreePort(t), t.TempDir()
	start := func() *kfake.Cluster {
		c, err := kfake.NewCluster(kfake.Ports(port), kfake.DataDir(dir), kfake.AllowAutoTopicCreation())
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	cluster := start()
	t.Cleanup(func() { cluster.Close() })
	brokers := cluster.ListenAddrs()
	if err := cluster.CreateTopic(topic, 1, nil); err != nil {
		t.Fatal(err)
	}
	producer := harness.NewKgoClient(t, brokers)
	produce(t, producer, record("before", "p0-a", 0))

	cl := harness.NewKgoClient(t, brokers, kgo.ConsumerGroup("billing"), kgo.ConsumeTopics(topic),
		kgo.AutoCommitMarks(), kgo.BlockRebalanceOnPoll(), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ib, err := inbox.New(inbox.Config{Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var reported []error
	c := &inboxkgo.Consumer{Client: cl, Inbox: ib, DB: pool, Handler: recordEffect, CommitEach: true,
		OnClientError: func(err error) {
			mu.Lock()
			defer mu.Unlock()
			reported = append(reported, err)
		}}
	stop, ended := running(t, c)
	harness.WaitFor(t, 30*time.Second, "the first record is applied", func() bool {
		return db.QueryInt64(t, `SELECT count(*) FROM effects`) == 1
	})

	cluster.Close()
	outage := time.Now()
	refused := func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, err := range reported {
			if errors.Is(err, syscall.ECONNREFUSED) {
				return true
			}
		}
		return false
	}
	harness.WaitFor(t, time.Minute, "a refused connection is reported, and Run polls on through more errors", func() bool {
		select {
		case <-ended:
			t.Fatalf("Run returned during the outage: %v", stop())
		default:
		}
		mu.Lock()
		n := len(reported)
		mu.Unlock()
		return refused() && n >= 3
	})

	cluster = start()
	t.Logf("the broker was down %v", time.Since(outage).Round(100*time.Millisecond))
	produce(t, harness.NewKgoClient(t, brokers), record("after", "p0-a", 0))
	harness.WaitFor(t, time.Minute, "the record produced after the outage is applied", func() bool {
		select {
		case <-ended:
			t.Fatalf("Run returned after the outage: %v", stop())
		default:
		}
		return db.QueryInt64(t, `SELECT count(*) FROM effects WHERE event_id = 'after'`) == 1
	})
	if err := stop(); err != nil {
		t.Errorf("run: %v", err)
	}
	if got := db.QueryString(t, `SELECT string_agg(event_id, ',' ORDER BY seq) FROM effects`); got != "before,after" {
		t.Errorf("effects %q, want before,after, each once", got)
	}
	mu.Lock()
	var sample []string
	for _, err := range reported[:min(3, len(reported))] {
		sample = append(sample, err.Error())
	}
	t.Logf("%d client errors reported during the outage, e.g. %s", len(reported), strings.Join(sample, "; "))
	mu.Unlock()
}

// A refusal that retrying cannot fix ends Run with the error: here the
// coordinator refuses the group (GROUP_AUTHORIZATION_FAILED to every
// JoinGroup).
func TestRunReturnsARefusal(t *testing.T) {
	_, pool := consumerDB(t)
	k := harness.StartKfake(t)
	k.CreateTopic(t, topic, 1, nil)
	cluster := k.Cluster()
	cluster.ControlKey(kmsg.JoinGroup.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		resp := req.ResponseKind().(*kmsg.JoinGroupResponse)
		resp.ErrorCode = kerr.GroupAuthorizationFailed.Code
		return resp, nil, true
	})
	cl := harness.NewKgoClient(t, k.Brokers(), kgo.ConsumerGroup("billing"), kgo.ConsumeTopics(topic),
		kgo.AutoCommitMarks(), kgo.BlockRebalanceOnPoll())
	ib, err := inbox.New(inbox.Config{Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	c := &inboxkgo.Consumer{Client: cl, Inbox: ib, DB: pool, Handler: recordEffect}
	stop, ended := running(t, c)
	select {
	case <-ended:
	case <-time.After(time.Minute):
		t.Fatal("Run did not return within a minute of its group being refused")
	}
	if err := stop(); !errors.Is(err, kerr.GroupAuthorizationFailed) {
		t.Errorf("Run returned %v, want the group authorization failure", err)
	}
}

// A rebalance while a partition's batch is being retried: a second member
// joins while the first retries a record on partition 2, and the group
// rebalances with that batch in flight (partition 2 stays or moves, as the
// balancer chooses). Once the record succeeds, every event is applied
// exactly once, partition 2 in order, and every offset reaches the end.
func TestRebalanceDuringARetryAppliesEachEventOnce(t *testing.T) {
	db, pool := consumerDB(t)
	k := harness.StartKfake(t)
	k.CreateTopic(t, topic, 4, nil)
	producer := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	var recs []*kgo.Record
	batch := func(round int) []*kgo.Record {
		var rs []*kgo.Record
		for p := range int32(4) {
			for i := range 5 {
				rs = append(rs, record(fmt.Sprintf("r%d-p%d-e%d", round, p, i), fmt.Sprintf("p%d-a%d", p, i), p))
			}
		}
		return rs
	}
	first := append([]*kgo.Record{record("stuck", "p2-stuck", 2)}, batch(0)...)
	produce(t, producer, first...)
	recs = append(recs, first...)

	ib, err := inbox.New(inbox.Config{Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	var failing atomic.Bool
	var failures atomic.Int64
	failing.Store(true)
	member := func() *inboxkgo.Consumer {
		cl := harness.NewKgoClient(t, k.Brokers(), kgo.ConsumerGroup("billing"), kgo.ConsumeTopics(topic),
			kgo.AutoCommitMarks(), kgo.BlockRebalanceOnPoll(), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
		return &inboxkgo.Consumer{Client: cl, Inbox: ib, DB: pool, CommitEach: true, RetryMax: 50 * time.Millisecond,
			Handler: func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
				if ev.ID == "stuck" && failing.Load() {
					return errors.New("downstream refuses this aggregate")
				}
				return recordEffect(ctx, tx, ev)
			},
			OnError: func(*kgo.Record, error) { failures.Add(1) },
		}
	}
	stopA, endedA := running(t, member())
	harness.WaitFor(t, 30*time.Second, "the stuck record fails", func() bool { return failures.Load() > 0 })
	stopB, endedB := running(t, member())
	harness.WaitFor(t, 30*time.Second, "the group has two members with partitions each", func() bool {
		gi := k.Cluster().GroupInfo("billing")
		return gi != nil && gi.State == "Stable" && len(gi.Members) == 2 &&
			gi.Members[0].NumAssigned() > 0 && gi.Members[1].NumAssigned() > 0
	})
	second := batch(1)
	produce(t, producer, second...)
	recs = append(recs, second...)
	failing.Store(false)

	harness.WaitFor(t, time.Minute, "every record is applied and its offset committed", func() bool {
		offsets := harness.CommittedOffsets(t, k.Brokers(), "billing", topic)
		return db.QueryInt64(t, `SELECT count(DISTINCT event_id) FROM effects`) == int64(len(recs)) &&
			offsets[0] == 10 && offsets[1] == 10 && offsets[2] == 11 && offsets[3] == 10
	})
	for _, ended := range []<-chan struct{}{endedA, endedB} {
		select {
		case <-ended:
			t.Fatalf("a member's Run returned: %v, %v", stopA(), stopB())
		default:
		}
	}
	if err := stopA(); err != nil {
		t.Errorf("run A: %v", err)
	}
	if err := stopB(); err != nil {
		t.Errorf("run B: %v", err)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM effects`); n != int64(len(recs)) {
		t.Errorf("%d effects for %d records: some applied twice", n, len(recs))
	}
	if got := db.QueryString(t, `SELECT string_agg(event_id, ',' ORDER BY seq) FROM effects WHERE event_id LIKE '%p2-e0' OR event_id = 'stuck'`); got != "stuck,r0-p2-e0,r1-p2-e0" {
		t.Errorf("partition 2's first records applied as %q, want stuck,r0-p2-e0,r1-p2-e0", got)
	}
}
