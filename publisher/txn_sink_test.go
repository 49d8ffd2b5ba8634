package publisher

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Behind channels, acks still wait for the commit; Flush commits at once,
// and in the middle of a source transaction that is a counted split.
func TestTxnSinkAcksAfterCommitAndFlushes(t *testing.T) {
	k := harness.StartKfake(t)
	w := newTxnWorld(t, k.Brokers())
	w.tcfg.Interval = time.Hour // only Flush commits here
	d := w.sink()
	ctx := context.Background()
	txns := makeTxns("sinkflush", 3, 3, 2) // 1, 2 and 3 events

	if _, err := d.stream(ctx, txns[:2], nil); err != nil {
		t.Fatal(err)
	}
	if harness.Poll(300*time.Millisecond, func() bool { a, f := d.counts(); return a+f > 0 }) {
		t.Fatal("an outcome came before the Kafka transaction committed")
	}
	if err := d.settle(ctx); err != nil {
		t.Fatalf("failed: %v", err)
	}
	d.waitFor(10*time.Second, "the commit's report", func() bool { return len(d.reports) == 1 })
	if st := d.stats(); st.committed != 1 || st.lastCommitted != txns[1].end || st.split != 0 {
		t.Fatalf("after the flush at a boundary: %v", st)
	}

	for _, ev := range txns[2].events { // its commit not read yet
		r, err := d.build(ctx, ev)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.send(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.settle(ctx); err != nil {
		t.Fatalf("failed: %v", err)
	}
	d.waitFor(10*time.Second, "the split commit's reports", func() bool { return len(d.reports) == 3 })
	if st := d.stats(); st.committed != 2 || st.split != 1 || st.lastCommitted != txns[1].end {
		t.Fatalf("after the flush inside a source transaction: %v, want a split and the progress still at %v", st, txns[1].end)
	}
	consumeExactlyOnce(t, k.Brokers(), "sinkflush.order", eventIDs(txns))
}

// A fenced sink reports every record it was given exactly once, failed as
// fenced, the ones sent after the fence too, and commits nothing.
func TestTxnSinkFencedReportsEveryRecordOnce(t *testing.T) {
	skipSaramaTxnErrorRace(t)
	k := harness.StartKfake(t)
	w := newTxnWorld(t, k.Brokers())
	w.tcfg.Interval = time.Hour
	// Produce requests refused for the old epoch are retried until
	// MaxAge before their records fail; keep the test short.
	w.tcfg.MaxAge = 2 * time.Second
	old := w.sink()
	ctx := context.Background()
	txns := makeTxns("sinkfence", 3, 2, 2) // 1, 2 and 1 events
	if _, err := old.stream(ctx, txns[:1], nil); err != nil {
		t.Fatal(err)
	}
	w.sink() // the newer producer fences old
	if _, err := old.stream(ctx, txns[1:2], nil); err != nil {
		t.Fatal(err)
	}
	if err := old.put(ctx, sink.Item{Flush: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := old.stream(ctx, txns[2:], nil); err != nil {
		t.Fatal(err)
	}
	if err := old.settle(ctx); !errors.Is(err, sink.ErrFenced) {
		t.Fatalf("settled with %v, want sink.ErrFenced", err)
	}
	for _, f := range old.failures() {
		if f.Class != sink.ClassFenced || !errors.Is(f, sink.ErrFenced) {
			t.Fatalf("outcome %v, want failed as fenced", f)
		}
	}
	if harness.Poll(300*time.Millisecond, func() bool { a, f := old.counts(); return a+f > 4 }) {
		t.Fatal("a record was reported twice")
	}
	if acked, failed := old.counts(); acked != 0 || failed != 4 {
		t.Fatalf("%d acked and %d failed, want each of the 4 records failed once", acked, failed)
	}
	if st := old.stats(); st.committed != 0 {
		t.Fatalf("the fenced sink committed %d transactions", st.committed)
	}
}

// A source transaction's end reaches the sink on the same channel as its
// records, so it is applied after every one of them, however many queue
// on Input while a commit is under way: applied before, it would commit
// the transaction's progress without its records.
func TestTxnSinkAppliesQueuedRecordsBeforeTheirBoundary(t *testing.T) {
	k := harness.StartKfake(t)
	w := newTxnWorld(t, k.Brokers())
	w.tcfg.Interval = time.Hour // only Flush commits here
	d := w.sink()
	// One source transaction of 200 events, sent and ended at once, then
	// flushed: the sink sees the boundary and the flush while the last of
	// the records still wait on Input.
	txns := makeTxns("sinkqueue", 200, 200, 7)[199:]
	if _, err := d.stream(context.Background(), txns, nil); err != nil {
		t.Fatal(err)
	}
	if err := d.settle(context.Background()); err != nil {
		t.Fatalf("failed: %v", err)
	}
	d.waitFor(10*time.Second, "the commit's report", func() bool { return len(d.reports) == 1 })
	if st := d.stats(); st.committed != 1 || st.split != 0 || st.lastCommitted != txns[0].end {
		t.Fatalf("stats %v: want one Kafka transaction holding the whole source transaction and its progress at %v", st, txns[0].end)
	}
	consumeExactlyOnce(t, k.Brokers(), "sinkqueue.order", eventIDs(txns))
}

// A boundary that arrives right after its record, while the sink is busy
// with the previous transaction, must close the Kafka transaction holding
// that record. The old sink carried boundaries apart from records and
// once applied such a boundary before its record, which then waited in a
// Kafka transaction for a boundary that had already come: on a quiet
// outbox, invisible to read_committed consumers until the next event or
// the broker's abort at its timeout. Here the second transaction's record
// and boundary follow the first at once, and nothing comes after them.
func TestTxnSinkBoundaryReportedWhileDrainingWaitsForItsRecord(t *testing.T) {
	k := harness.StartKfake(t)
	w := newTxnWorld(t, k.Brokers())
	w.tcfg.Interval = 50 * time.Millisecond
	d := w.sink()
	txns := makeTxns("sinkdrain", 2, 1, 2) // one event each
	if _, err := d.stream(context.Background(), txns, nil); err != nil {
		t.Fatal(err)
	}
	d.waitFor(10*time.Second, "both records acknowledged after both boundaries", func() bool {
		return len(d.acked) == 2 && len(d.failed) == 0
	})
	d.waitFor(10*time.Second, "the progress at the second boundary", func() bool {
		return len(d.reports) > 0 && d.reports[len(d.reports)-1].End == txns[1].end
	})
	if st := d.stats(); st.split != 0 || st.lastCommitted != txns[1].end {
		t.Fatalf("stats %v: want no split and the progress at %v", st, txns[1].end)
	}
	consumeExactlyOnce(t, k.Brokers(), "sinkdrain.order", eventIDs(txns))
}

// The interval runs from the first record's build: a record that waited
// out the previous commit is not made to wait a whole interval more, but a
// transaction stays open at least half an interval. Catching up, it stays
// open as long as the relay lags behind the source commit, up to a second.
func TestCommitDeadline(t *testing.T) {
	began := time.Date(2026, 12, 1, 6, 0, 0, 0, time.UTC)
	const interval = 100 * time.Millisecond
	recent := began.Add(-5 * time.Millisecond) // a source commit the relay keeps up with
	for _, tc := range []struct {
		name                     string
		firstBuilt, sourceCommit time.Time
		commitCost               time.Duration
		want                     time.Time
	}{
		{"built as it began", began, recent, 0, began.Add(interval)},
		{"waited 30 ms for a commit", began.Add(-30 * time.Millisecond), recent.Add(-30 * time.Millisecond), 0, began.Add(70 * time.Millisecond)},
		{"waited longer than half an interval", began.Add(-90 * time.Millisecond), began.Add(-95 * time.Millisecond), 0, began.Add(interval / 2)},
		{"no build time", time.Time{}, recent, 0, began.Add(interval)},
		{"build time after the begin", began.Add(time.Second), recent, 0, began.Add(interval)},
		{"no source commit time", began, time.Time{}, 0, began.Add(interval)},
		{"catching up 400 ms behind", began.Add(-90 * time.Millisecond), began.Add(-400 * time.Millisecond), 0, began.Add(400 * time.Millisecond)},
		{"commits take 20 ms", began, recent, 20 * time.Millisecond, began.Add(80 * time.Millisecond)},
		{"commits take longer than half an interval", began, recent, 80 * time.Millisecond, began.Add(interval / 2)},
		{"catching up a minute behind", began.Add(-90 * time.Millisecond), began.Add(-time.Minute), 0, began.Add(time.Second)},
	} {
		if got := commitDeadline(tc.firstBuilt, tc.sourceCommit, began, interval, tc.commitCost); !got.Equal(tc.want) {
			t.Errorf("%s: deadline %v after the begin, want %v", tc.name, got.Sub(began), tc.want.Sub(began))
		}
	}
}

// A Kafka transaction that began catching up, its first record's source
// commit long past, commits at the steady deadline once a source
// transaction's end shows the relay caught up: the end of a backlog must
// not wait out the catch-up interval. It used to, and a drain's last
// transaction sat a second before anything of it was visible.
func TestTxnSinkCatchingUpEndsWhenCaughtUp(t *testing.T) {
	k := harness.StartKfake(t)
	w := newTxnWorld(t, k.Brokers())
	w.tcfg.Interval = 50 * time.Millisecond
	d := w.sink()
	txns := makeTxns("sinkcaughtup", 2, 1, 2) // one event each
	start := time.Now()
	txns[0].events[0].CommitTime = start.Add(-time.Minute) // a backlog's
	txns[1].events[0].CommitTime = start                   // the newest
	for _, st := range txns {
		r, err := d.build(context.Background(), st.events[0])
		if err != nil {
			t.Fatal(err)
		}
		if err := d.send(context.Background(), r); err != nil {
			t.Fatal(err)
		}
		end := &sink.SourceEnd{Txn: st.id, End: st.end, CommitTime: st.events[0].CommitTime}
		if err := d.put(context.Background(), sink.Item{End: end}); err != nil {
			t.Fatal(err)
		}
	}
	d.waitFor(10*time.Second, "the commit", func() bool { return len(d.reports) > 0 })
	if took := time.Since(start); took >= catchUpInterval {
		t.Fatalf("committed %v after the caught-up end; want the %v interval, not the %v catch-up interval", took, w.tcfg.Interval, catchUpInterval)
	}
	if st := d.stats(); st.committed != 1 || st.lastCommitted != txns[1].end {
		t.Fatalf("stats %v: want one commit up to %v", st, txns[1].end)
	}
}

// The last transaction of a drained backlog, its source commit long past,
// commits once nothing more arrives for half an interval, not after the
// catch-up interval: the backlog ended.
func TestTxnSinkCatchingUpCommitsWhenInputStops(t *testing.T) {
	k := harness.StartKfake(t)
	w := newTxnWorld(t, k.Brokers())
	w.tcfg.Interval = 50 * time.Millisecond
	d := w.sink()
	txns := makeTxns("sinkidle", 1, 1, 1)
	start := time.Now()
	txns[0].events[0].CommitTime = start.Add(-time.Minute)
	r, err := d.build(context.Background(), txns[0].events[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := d.send(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	end := &sink.SourceEnd{Txn: txns[0].id, End: txns[0].end, CommitTime: txns[0].events[0].CommitTime}
	if err := d.put(context.Background(), sink.Item{End: end}); err != nil {
		t.Fatal(err)
	}
	d.waitFor(10*time.Second, "the commit", func() bool { return len(d.reports) > 0 })
	took := time.Since(start)
	t.Logf("committed %v after the last item", took)
	if took >= catchUpInterval {
		t.Fatalf("committed %v after the last item; want about the %v interval, not the %v catch-up interval", took, w.tcfg.Interval, catchUpInterval)
	}
}
