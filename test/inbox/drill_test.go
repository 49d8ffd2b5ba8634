package inboxdrills

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/inbox/inboxkgo"
	"github.com/outbox-relay/outbox-relay/inbox/inboxsarama"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// world is one drill's consumer database, topic and Kafka clients.
type world struct {
	t       *testing.T
	db      *harness.PGDatabase
	pool    *pgxpool.Pool
	k       *harness.ApacheKafka
	topic   string
	adm     *kadm.Client
	produce *kgo.Client
}

func newWorld(t *testing.T, partitions int32) *world {
	t.Helper()
	return newWorldOn(t, partitions, harness.ApacheKafkaOptions{})
}

// newWorldOn is newWorld on the shared cluster of opts; the writer's
// producer reaches the brokers directly, past any proxy in front of them.
func newWorldOn(t *testing.T, partitions int32, opts harness.ApacheKafkaOptions) *world {
	t.Helper()
	k := harness.RequireApacheKafka(t, opts)
	w := &world{t: t, db: pg.CreateTestDatabase(t), k: k,
		topic: fmt.Sprintf("inbox.drill.%s.%d", strings.ToLower(strings.NewReplacer("/", ".", "=", ".").Replace(t.Name())), time.Now().UnixNano())}
	ddl, err := inbox.SQL(inbox.Tables{})
	if err != nil {
		t.Fatal(err)
	}
	w.db.Exec(t, ddl)
	w.db.Exec(t, `CREATE TABLE effects (seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL)`)
	if w.pool, err = pgxpool.New(context.Background(), w.db.DSN()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.pool.Close)
	if err := k.CreateTopic(w.topic, partitions, 1, nil); err != nil {
		t.Fatalf("%v%s", err, k.LogTail(0, 30))
	}
	admClient := harness.NewKgoClient(t, k.Brokers())
	w.adm = kadm.NewClient(admClient)
	// The writer's producer learns of added partitions within a second, as
	// a relay's does at its metadata refresh; keys go where murmur2 puts
	// them, as the relay's partitioner does.
	w.produce = harness.NewKgoClient(t, k.DirectBrokers(), kgo.MetadataMinAge(250*time.Millisecond), kgo.MetadataMaxAge(time.Second), kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)))
	return w
}

// record is an event of aggregate agg at version v in the relay's format.
func (w *world) record(agg string, v int) *kgo.Record {
	id := fmt.Sprintf("%s-v%d", agg, v)
	return &kgo.Record{Topic: w.topic, Key: []byte(agg), Value: []byte(`{}`), Headers: []kgo.RecordHeader{
		{Key: "event_id", Value: []byte(id)}, {Key: "event_type", Value: []byte("Credited")},
		{Key: "aggregate_type", Value: []byte("account")}, {Key: "aggregate_id", Value: []byte(agg)},
		{Key: "aggregate_version", Value: []byte(fmt.Sprint(v))},
	}}
}

// write produces round after round at a steady pace, the records
// recordsOf gives for each; after each round it calls after(round).
func (w *world) write(ctx context.Context, rounds int, pace time.Duration, recordsOf func(round int) []*kgo.Record, after func(round int)) error {
	tick := time.NewTicker(pace)
	defer tick.Stop()
	for round := 1; round <= rounds; round++ {
		if err := w.produce.ProduceSync(ctx, recordsOf(round)...).FirstErr(); err != nil {
			return fmt.Errorf("round %d: %w", round, err)
		}
		if after != nil {
			after(round)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
	return nil
}

// versionsOf is recordsOf for aggregates that each take one version a
// round, from the round they start at, leaving out the versions skip
// names.
func (w *world) versionsOf(aggs []string, start map[string]int, skip map[string]int) func(round int) []*kgo.Record {
	return func(round int) []*kgo.Record {
		var recs []*kgo.Record
		for _, agg := range aggs {
			if v := round - start[agg] + 1; v >= 1 && skip[agg] != v {
				recs = append(recs, w.record(agg, v))
			}
		}
		return recs
	}
}

// caughtUp reports whether group's committed offsets reached the end of
// every partition of the topic.
func (w *world) caughtUp(group string) bool {
	ends, err := w.adm.ListEndOffsets(context.Background(), w.topic)
	if err != nil {
		return false
	}
	committed := harness.CommittedOffsets(w.t, w.k.Brokers(), group, w.topic)
	all := true
	ends.Each(func(o kadm.ListedOffset) {
		if committed[o.Partition] != o.Offset {
			all = false
		}
	})
	return all
}

// consumerFunc runs one group member applying records through ib with h
// until ctx ends.
type consumerFunc func(ctx context.Context, w *world, group string, ib *inbox.Inbox, h inbox.Handler) error

// Both adapters with the settings docs/inbox.md gives, plus a metadata
// refresh of a second (the docs' advice for a topic whose partitions are
// added: otherwise the members see the new partitions after sarama's 10
// minutes or kgo's 5).
var adapters = map[string]consumerFunc{
	"inboxsarama": func(ctx context.Context, w *world, group string, ib *inbox.Inbox, h inbox.Handler) error {
		cfg := inboxsarama.NewConfig()
		cfg.Version = sarama.V3_6_0_0
		cfg.Metadata.RefreshFrequency = time.Second
		cg, err := inboxsarama.NewConsumerGroup(w.k.Brokers(), group, cfg)
		if err != nil {
			return err
		}
		defer cg.Close()
		handler := &inboxsarama.Handler{Inbox: ib, DB: w.pool, Handler: h, CommitEach: true}
		for ctx.Err() == nil {
			if err := cg.Consume(ctx, []string{w.topic}, handler); errors.Is(err, sarama.ErrClosedConsumerGroup) {
				break
			}
		}
		return nil
	},
	"inboxkgo": func(ctx context.Context, w *world, group string, ib *inbox.Inbox, h inbox.Handler) error {
		cl, err := kgo.NewClient(kgo.SeedBrokers(w.k.Brokers()...), kgo.ConsumerGroup(group), kgo.ConsumeTopics(w.topic),
			kgo.AutoCommitMarks(), kgo.BlockRebalanceOnPoll(), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
			kgo.MetadataMinAge(250*time.Millisecond), kgo.MetadataMaxAge(time.Second))
		if err != nil {
			return err
		}
		defer cl.Close()
		return (&inboxkgo.Consumer{Client: cl, Inbox: ib, DB: w.pool, Handler: h, CommitEach: true}).Run(ctx)
	},
}

// members runs n members of group until the returned stop is called,
// which returns the first error a member returned.
func (w *world) members(n int, run consumerFunc, group string, ib *inbox.Inbox, h inbox.Handler) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { errs[i] = run(ctx, w, group, ib, h) })
	}
	stopped := false
	stop = func() error {
		if !stopped {
			stopped = true
			cancel()
			wg.Wait()
		}
		return errors.Join(errs...)
	}
	w.t.Cleanup(func() { _ = stop() })
	return stop
}

// slowEffect records the event's effect and takes a few milliseconds more,
// so batches hold their aggregates' locks long enough for batches of
// other partitions to wait on them.
func slowEffect(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
	if _, err := tx.Exec(ctx, `INSERT INTO effects (event_id, aggregate_id, version) VALUES ($1, $2, $3)`, ev.ID, ev.AggregateID, ev.Version); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `SELECT pg_sleep(0.005)`)
	return err
}

// checkApplied checks, from the consumer's database, that each
// aggregate's versions 1..last[agg] (but the skipped one) took effect once
// each, in order, and that nothing is left parked.
func (w *world) checkApplied(last map[string]int, skip map[string]int) {
	w.t.Helper()
	want := 0
	for agg, n := range last {
		var vs []string
		for v := 1; v <= n; v++ {
			if skip[agg] != v {
				vs = append(vs, fmt.Sprint(v))
				want++
			}
		}
		if got := w.db.QueryString(w.t, `SELECT COALESCE(string_agg(version::text, ',' ORDER BY seq), '') FROM effects WHERE aggregate_id = $1`, agg); got != strings.Join(vs, ",") {
			w.t.Errorf("%s took effect as versions %q, want %q", agg, got, strings.Join(vs, ","))
		}
		if got := w.db.QueryInt64(w.t, `SELECT version FROM inbox_versions WHERE aggregate_id = $1`, agg); got != int64(n) {
			w.t.Errorf("%s is at version %d, want %d", agg, got, n)
		}
	}
	total, distinct := w.db.QueryInt64(w.t, `SELECT count(*) FROM effects`), w.db.QueryInt64(w.t, `SELECT count(DISTINCT event_id) FROM effects`)
	parked := w.db.QueryInt64(w.t, `SELECT count(*) FROM inbox_parked`)
	if total != int64(want) || distinct != int64(want) || parked != 0 {
		w.t.Errorf("%d effects (%d events) of %d, %d events left parked", total, distinct, want, parked)
	}
}

// A parked event was never released when its predecessor's batch had
// waited on the lock of the batch that parked it (issue 55, item 1). The
// drill: writers at a steady pace, an aggregate's early versions on the
// topic's first three partitions, its partition count raised to six while
// the members lag behind, so half the aggregates' later versions land on
// new partitions and are applied while their predecessors still wait on
// the old ones, two partitions' batches of one aggregate at once (the
// consumer's database stalls across the change, so the group lags as one
// that was behind does). Every event must take effect once, in order,
// and nothing may stay parked. Before the fix, 6 to 12 of 1,080 events
// stayed parked for ever in each of four runs, with either adapter.
func TestDrillPartitionsAddedUnderLiveTraffic(t *testing.T) {
	for _, name := range []string{"inboxsarama", "inboxkgo"} {
		t.Run(name, func(t *testing.T) {
			// Whether an event arrives before its predecessor is up to the
			// group's timing: a run where none did proves nothing of the
			// release, so it is run again (each run is checked for loss and
			// order all the same), up to three times.
			for attempt := 1; ; attempt++ {
				gaps := partitionsAddedUnderLiveTraffic(t, name)
				if gaps > 0 {
					return
				}
				if attempt == 3 {
					t.Fatalf("in %d runs no event arrived before its predecessor: the drill did not exercise what it is for", attempt)
				}
				t.Logf("run %d: no event arrived before its predecessor; running again", attempt)
			}
		})
	}
}

// partitionsAddedUnderLiveTraffic is one run of the drill with adapter
// name; it checks every event was applied once and in order, and returns
// how many arrived before their predecessor.
func partitionsAddedUnderLiveTraffic(t *testing.T, name string) (gaps int64) {
	t.Helper()
	w := newWorld(t, 3)
	// 60 aggregates take a version a round throughout; from the
	// change on, 60 new ones start at version 1, so the new
	// partitions' batches mix events that park with events that
	// apply (and hold their locks while the handler works).
	const rounds, change = 12, 6
	var aggs []string
	start, last := map[string]int{}, map[string]int{}
	for i := range 60 {
		old, fresh := fmt.Sprintf("acct-%03d", i), fmt.Sprintf("late-%03d", i)
		aggs = append(aggs, old, fresh)
		start[old], start[fresh] = 1, change+1
		last[old], last[fresh] = rounds, rounds-change
	}
	metrics := inbox.NewMetrics("billing")
	ib, err := inbox.New(inbox.Config{Consumer: "billing", CheckVersions: true, Metrics: metrics})
	if err != nil {
		t.Fatal(err)
	}
	// The consumer's database stalls (a lock its handlers wait
	// for) from the round before the change until the group has
	// all six partitions and two rounds went to them: then the
	// members apply the old partitions' last versions and the new
	// partitions' first ones at once, as a group that lagged does.
	stall := w.db.Connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := w.members(2, adapters[name], "billing", ib, stallingEffect)
	stalled, moved := make(chan error, 1), make(chan error, 1)
	var writeErr error
	var writer sync.WaitGroup
	writer.Go(func() {
		writeErr = w.write(ctx, rounds, 300*time.Millisecond, w.versionsOf(aggs, start, nil), func(round int) {
			switch round {
			case change - 1:
				_, err := stall.Exec(ctx, `SELECT pg_advisory_lock($1)`, stallLock)
				stalled <- err
			case change:
				_, err := w.adm.UpdatePartitions(ctx, 6, w.topic)
				w.produce.ForceMetadataRefresh()
				moved <- err
			}
		})
	})
	if err := <-stalled; err != nil {
		t.Fatal(err)
	}
	if err := <-moved; err != nil {
		t.Fatalf("raise the partition count: %v", err)
	}
	harness.WaitFor(t, time.Minute, "the group has all six partitions and the new ones have records", func() bool {
		return w.assigned("billing") == 6 && w.newPartitionsHaveRecords(3)
	})
	if _, err := stall.Exec(ctx, `SELECT pg_advisory_unlock($1)`, stallLock); err != nil {
		t.Fatal(err)
	}
	writer.Wait()
	if writeErr != nil {
		t.Fatal(writeErr)
	}
	harness.WaitFor(t, 3*time.Minute, "the members' offsets reach the end of all six partitions", func() bool {
		return w.caughtUp("billing")
	})
	if err := stop(); err != nil {
		t.Errorf("members: %v", err)
	}
	w.checkApplied(last, nil)
	c := metrics.Counts()
	t.Logf("%s: %d events of %d aggregates, %d parked on arrival, %d duplicates skipped, %d applied",
		name, c.Applied+c.Duplicates+c.StaleVersions, len(aggs), c.VersionGaps, c.Duplicates+c.StaleVersions, c.Applied)
	return c.VersionGaps
}

// stallLock is the advisory lock a drill holds to stall the handlers.
const stallLock = 5555

// stallingEffect is slowEffect that first waits while the drill holds
// stallLock.
func stallingEffect(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock_shared($1)`, stallLock); err != nil {
		return err
	}
	return slowEffect(ctx, tx, ev)
}

// assigned is how many partitions of the topic group's members hold.
func (w *world) assigned(group string) int {
	groups, err := w.adm.DescribeGroups(context.Background(), group)
	if err != nil {
		return 0
	}
	n := 0
	for _, g := range groups {
		n += len(g.AssignedPartitions()[w.topic])
	}
	return n
}

// newPartitionsHaveRecords reports whether every partition from the
// first-th on holds a record.
func (w *world) newPartitionsHaveRecords(first int32) bool {
	ends, err := w.adm.ListEndOffsets(context.Background(), w.topic)
	if err != nil {
		return false
	}
	all, seen := true, 0
	ends.Each(func(o kadm.ListedOffset) {
		if o.Partition >= first {
			seen++
			all = all && o.Offset > 0
		}
	})
	return all && seen > 0
}

// The procedure docs/inbox.md gives for a version that never comes,
// followed step by step while writers keep writing: five aggregates'
// version 3 is never written; their later versions park; Overdue lists
// them past MissingAfter; SkipMissing with each Missing.Waiting-1 records
// the skip and applies what waited, under the members' feet; the
// aggregates go on with the versions written after. Every other event
// takes effect once, in order; nothing stays parked.
func TestDrillSkipMissingWhileConsuming(t *testing.T) {
	w := newWorld(t, 3)
	const rounds = 12
	var aggs []string
	skip := map[string]int{}
	for i := range 40 {
		agg := fmt.Sprintf("acct-%03d", i)
		aggs = append(aggs, agg)
		if i%8 == 0 {
			skip[agg] = 3
		}
	}
	metrics := inbox.NewMetrics("billing")
	ib, err := inbox.New(inbox.Config{Consumer: "billing", CheckVersions: true, Metrics: metrics, MissingAfter: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	stop := w.members(2, adapters["inboxkgo"], "billing", ib, slowEffect)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var writeErr error
	var writer sync.WaitGroup
	start, last := map[string]int{}, map[string]int{}
	for _, agg := range aggs {
		start[agg], last[agg] = 1, rounds
	}
	writer.Go(func() { writeErr = w.write(ctx, rounds, 500*time.Millisecond, w.versionsOf(aggs, start, skip), nil) })

	// Step 1: what waits (the gauge, through Overdue).
	var missing []inbox.Missing
	harness.WaitFor(t, time.Minute, "Overdue lists the five aggregates", func() bool {
		var err error
		missing, err = ib.Overdue(ctx, w.pool)
		return err == nil && len(missing) == len(skip)
	})
	if c := metrics.Counts(); c.MissingPredecessors != int64(len(skip)) {
		t.Errorf("inbox_missing_predecessors %d, want %d", c.MissingPredecessors, len(skip))
	}
	// Step 2 (is the event in the outbox table?) has its answer here: the
	// writer never wrote it. Step 3, as the page gives it.
	for _, m := range missing {
		if skip[m.AggregateID] != 3 || m.Applied != 2 || m.Waiting != 4 {
			t.Fatalf("Overdue listed %+v, want an aggregate missing version 3", m)
		}
		s, err := ib.SkipMissing(ctx, w.pool, m.AggregateType, m.AggregateID, m.Waiting-1, "drill: version never written", slowEffect)
		if err != nil {
			t.Fatalf("SkipMissing %s: %v", m.AggregateID, err)
		}
		if s.From != 3 || s.Through != 3 || s.Released < 1 {
			t.Errorf("SkipMissing %s: %+v, want version 3 skipped and what waited released", m.AggregateID, s)
		}
	}
	writer.Wait()
	if writeErr != nil {
		t.Fatal(writeErr)
	}
	harness.WaitFor(t, 2*time.Minute, "the members' offsets reach the end", func() bool { return w.caughtUp("billing") })
	if err := stop(); err != nil {
		t.Errorf("members: %v", err)
	}
	// Step 4: the check the page gives.
	if m, err := ib.Overdue(ctx, w.pool); err != nil || len(m) != 0 {
		t.Errorf("Overdue after the skips: %+v, %v", m, err)
	}
	if n := w.db.QueryInt64(t, `SELECT count(*) FROM inbox_skipped WHERE consumer = 'billing' AND version = 3`); n != int64(len(skip)) {
		t.Errorf("%d skips recorded, want %d", n, len(skip))
	}
	w.checkApplied(last, skip)
	c := metrics.Counts()
	t.Logf("%d events written, %d versions skipped, %d parked on arrival, %d applied", len(aggs)*rounds-len(skip), c.SkippedVersions, c.VersionGaps, c.Applied)
}

// recordIn is the event of aggregate agg at version v as the relay writes
// it in format: relay (its own headers), cloudevents (binary mode) or
// debezium (the id header, the key as the aggregate id). The writer's
// aggregate_version header travels in every format.
func (w *world) recordIn(format, agg string, v int) *kgo.Record {
	rec := w.record(agg, v)
	id := fmt.Sprintf("%s-v%d", agg, v)
	version := kgo.RecordHeader{Key: "aggregate_version", Value: []byte(fmt.Sprint(v))}
	switch format {
	case "cloudevents":
		rec.Headers = []kgo.RecordHeader{
			{Key: "ce_specversion", Value: []byte("1.0")}, {Key: "ce_id", Value: []byte(id)},
			{Key: "ce_source", Value: []byte("/billing")}, {Key: "ce_type", Value: []byte("Credited")},
			{Key: "ce_subject", Value: []byte(agg)}, {Key: "content-type", Value: []byte("application/json")}, version,
		}
	case "debezium":
		rec.Headers = []kgo.RecordHeader{{Key: "id", Value: []byte(id)}, version}
	}
	return rec
}

// Changing --record-format while consumers check versions parked the next
// event of every existing aggregate for ever (issue 55, item 4): the
// formats without an aggregate type keyed versions under an empty type.
// The drill switches the writer from the relay's format to CloudEvents,
// then to Debezium's shape, then back, every four rounds, with the
// members running, each adapter in turn; aggregates are born in each
// period. Every event must take effect once, in order, nothing parked.
func TestDrillRecordFormatSwitchedUnderRunningConsumers(t *testing.T) {
	for _, name := range []string{"inboxsarama", "inboxkgo"} {
		t.Run(name, func(t *testing.T) {
			w := newWorld(t, 3)
			const rounds = 16
			formats := []string{"relay", "cloudevents", "debezium", "relay"}
			start, last := map[string]int{}, map[string]int{}
			var aggs []string
			for i := range 40 {
				// A quarter of the aggregates are born in each period.
				agg := fmt.Sprintf("acct-%03d", i)
				aggs = append(aggs, agg)
				start[agg] = 1 + 4*(i%4)
				last[agg] = rounds - start[agg] + 1
			}
			metrics := inbox.NewMetrics("billing")
			ib, err := inbox.New(inbox.Config{Consumer: "billing", CheckVersions: true, Metrics: metrics})
			if err != nil {
				t.Fatal(err)
			}
			stop := w.members(2, adapters[name], "billing", ib, slowEffect)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			err = w.write(ctx, rounds, 300*time.Millisecond, func(round int) []*kgo.Record {
				var recs []*kgo.Record
				for _, agg := range aggs {
					if v := round - start[agg] + 1; v >= 1 {
						recs = append(recs, w.recordIn(formats[(round-1)/4], agg, v))
					}
				}
				return recs
			}, nil)
			if err != nil {
				t.Fatal(err)
			}
			harness.WaitFor(t, 2*time.Minute, "the members' offsets reach the end", func() bool { return w.caughtUp("billing") })
			if err := stop(); err != nil {
				t.Errorf("members: %v", err)
			}
			w.checkApplied(last, nil)
			if n := w.db.QueryInt64(t, `SELECT count(*) FROM inbox_versions WHERE aggregate_type = ''`); n != 0 {
				t.Errorf("%d aggregates' versions left under the empty type after the switch back", n)
			}
			c := metrics.Counts()
			t.Logf("%s: %d applied, %d parked on arrival, %d duplicates skipped", name, c.Applied, c.VersionGaps, c.Duplicates+c.StaleVersions)
		})
	}
}
