package publisher

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

func (w *txnWorld) channelSink() *TxnSink {
	w.t.Helper()
	s, err := NewTxnSink(w.cfg, w.tcfg, zerolog.Nop())
	if err != nil {
		w.t.Fatalf("new exactly-once sink: %v", err)
	}
	w.t.Cleanup(func() { s.Close(10 * time.Second) })
	return s
}

// feed hands a source transaction's records to the sink as the read loop
// does; end says whether its commit was read.
func feed(t *testing.T, s *TxnSink, st sourceTxn, end bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, ev := range st.events {
		r, err := s.txn.BuildWait(ctx, ev)
		if err != nil {
			t.Fatal(err)
		}
		select {
		case s.Input() <- r:
		case <-ctx.Done():
			t.Fatal("the sink took no record")
		}
	}
	if end {
		s.EndTxn(st.id, st.end, time.Now())
	}
}

// outcomes reads n outcomes from the sink.
func outcomes(t *testing.T, s *TxnSink, n int) []Outcome {
	t.Helper()
	var got []Outcome
	deadline := time.After(20 * time.Second)
	for len(got) < n {
		select {
		case o := <-s.Outcomes():
			got = append(got, o)
		case <-deadline:
			t.Fatalf("got %d outcomes, want %d", len(got), n)
		}
	}
	return got
}

// Behind channels, acks still wait for the commit; Flush commits at once,
// and in the middle of a source transaction that is a counted split.
func TestTxnSinkAcksAfterCommitAndFlushes(t *testing.T) {
	k := harness.StartKfake(t)
	w := newTxnWorld(t, k.Brokers())
	w.tcfg.Interval = time.Hour // only Flush commits here
	s := w.channelSink()
	txns := makeTxns("sinkflush", 3, 3, 2) // 1, 2 and 3 events

	feed(t, s, txns[0], true)
	feed(t, s, txns[1], true)
	if harness.Poll(300*time.Millisecond, func() bool { return len(s.Outcomes()) > 0 }) {
		t.Fatal("an ack came before the Kafka transaction committed")
	}
	s.Flush()
	for _, o := range outcomes(t, s, 3) {
		if o.Err != nil {
			t.Fatalf("failed: %v", o.Err)
		}
	}
	if st := s.Stats(); st.Committed != 1 || st.LastCommitted != txns[1].end || st.SplitSourceTxns != 0 {
		t.Fatalf("after the flush at a boundary: %+v", st)
	}

	feed(t, s, txns[2], false) // its commit not read yet
	s.Flush()
	outcomes(t, s, 3)
	if st := s.Stats(); st.Committed != 2 || st.SplitSourceTxns != 1 || st.LastCommitted != txns[1].end {
		t.Fatalf("after the flush inside a source transaction: %+v, want a split and the progress still at %v", st, txns[1].end)
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
	old := w.channelSink()
	txns := makeTxns("sinkfence", 3, 2, 2) // 1, 2 and 1 events
	feed(t, old, txns[0], true)
	w.channelSink() // the newer producer fences old
	feed(t, old, txns[1], true)
	old.Flush()
	feed(t, old, txns[2], true)
	old.Flush()
	got := outcomes(t, old, 4)
	for _, o := range got {
		if o.Err == nil || o.Err.Class != ClassFenced || !errors.Is(o.Err, ErrFenced) {
			t.Fatalf("outcome %+v, want failed as fenced", o)
		}
	}
	if harness.Poll(300*time.Millisecond, func() bool { return len(old.Outcomes()) > 0 }) {
		t.Fatal("a record was reported twice")
	}
	if st := old.Stats(); st.Committed != 0 {
		t.Fatalf("the fenced sink committed %d transactions", st.Committed)
	}
}

// Records queue on Input while a commit is under way. A boundary the loop
// reported after queueing a transaction's records must not be applied
// before them: that commits the transaction's progress without its
// records, which only a later Kafka transaction would carry.
func TestTxnSinkAppliesQueuedRecordsBeforeTheirBoundary(t *testing.T) {
	k := harness.StartKfake(t)
	w := newTxnWorld(t, k.Brokers())
	w.tcfg.Interval = time.Hour // only Flush commits here
	s := w.channelSink()
	if cap(s.input) == 0 {
		t.Fatal("Input holds no records: nothing can queue")
	}
	// One source transaction of 200 events, sent and ended at once, then
	// flushed: the sink sees the boundary and the flush while the last of
	// the records still wait on Input.
	txns := makeTxns("sinkqueue", 200, 200, 7)[199:]
	feed(t, s, txns[0], true)
	s.Flush()
	for _, o := range outcomes(t, s, 200) {
		if o.Err != nil {
			t.Fatalf("failed: %v", o.Err)
		}
	}
	if st := s.Stats(); st.Committed != 1 || st.SplitSourceTxns != 0 || st.LastCommitted != txns[0].end {
		t.Fatalf("stats %+v: want one Kafka transaction holding the whole source transaction and its progress at %v", st, txns[0].end)
	}
	consumeExactlyOnce(t, k.Brokers(), "sinkqueue.order", eventIDs(txns))
}

// A boundary reported while the sink drains Input may belong to a record
// sent after the drain looked. The sink used to apply every boundary
// reported by then, the new one before its record, which then waited in a
// Kafka transaction for a boundary that had already come: on a quiet
// outbox, invisible to read_committed consumers until the next event or
// the broker's abort at its timeout. Here the loop's next record and its
// boundary arrive at exactly that moment.
func TestTxnSinkBoundaryReportedWhileDrainingWaitsForItsRecord(t *testing.T) {
	k := harness.StartKfake(t)
	w := newTxnWorld(t, k.Brokers())
	w.tcfg.Interval = 50 * time.Millisecond
	txns := makeTxns("sinkdrain", 2, 1, 2) // one event each
	var (
		s     *TxnSink
		late  *Record
		once  sync.Once
		fired = make(chan struct{})
	)
	s, err := newTxnSink(w.cfg, w.tcfg, zerolog.Nop(), func() {
		once.Do(func() {
			s.Input() <- late
			s.EndTxn(txns[1].id, txns[1].end, time.Now())
			close(fired)
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close(10 * time.Second) })
	if late, err = s.txn.BuildWait(context.Background(), txns[1].events[0]); err != nil {
		t.Fatal(err)
	}

	feed(t, s, txns[0], true)
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("the sink never drained Input after a boundary")
	}
	var got []Outcome
	deadline := time.After(10 * time.Second)
	for len(got) < 2 {
		select {
		case o := <-s.Outcomes():
			if o.Err != nil {
				t.Fatalf("failed: %v", o.Err)
			}
			got = append(got, o)
		case <-deadline:
			t.Fatalf("%d of 2 records acknowledged 10 s after both boundaries, with a %s interval: a Kafka transaction waits for a boundary that came before its record (stats %+v)",
				len(got), w.tcfg.Interval, s.Stats())
		}
	}
	if st := s.Stats(); st.SplitSourceTxns != 0 || st.LastCommitted != txns[1].end {
		t.Fatalf("stats %+v: want no split and the progress at %v", st, txns[1].end)
	}
	consumeExactlyOnce(t, k.Brokers(), "sinkdrain.order", eventIDs(txns))
}

// The interval runs from the first record's build: a record that waited
// out the previous commit is not made to wait a whole interval more, but a
// transaction stays open at least half an interval.
func TestCommitDeadline(t *testing.T) {
	began := time.Date(2026, 12, 1, 6, 0, 0, 0, time.UTC)
	const interval = 100 * time.Millisecond
	for _, tc := range []struct {
		name       string
		firstBuilt time.Time
		want       time.Time
	}{
		{"built as it began", began, began.Add(interval)},
		{"waited 30 ms for a commit", began.Add(-30 * time.Millisecond), began.Add(70 * time.Millisecond)},
		{"waited longer than half an interval", began.Add(-90 * time.Millisecond), began.Add(interval / 2)},
		{"no build time", time.Time{}, began.Add(interval)},
		{"build time after the begin", began.Add(time.Second), began.Add(interval)},
	} {
		if got := commitDeadline(tc.firstBuilt, began, interval); !got.Equal(tc.want) {
			t.Errorf("%s: deadline %v after the begin, want %v", tc.name, got.Sub(began), tc.want.Sub(began))
		}
	}
}
