package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// testSink builds Kafka records and reports what the test tells it.
type testSink struct {
	in       chan sink.Item
	outcomes chan sink.Outcome
	refuse   map[string]bool // event ids whose build fails for good
	once     sync.Once
}

func newTestSink() *testSink {
	return &testSink{in: make(chan sink.Item, 100), outcomes: make(chan sink.Outcome, 100), refuse: map[string]bool{}}
}

func (k *testSink) Build(ev *event.Event) (sink.Record, error) {
	if k.refuse[string(ev.EventID)] {
		return nil, &sink.Error{Class: sink.ClassPermanent, EventID: string(ev.EventID), Topic: "t", Partition: -1, Err: errors.New("refused")}
	}
	return publisher.BuildRecord(ev, "t")
}
func (k *testSink) Input() chan<- sink.Item       { return k.in }
func (k *testSink) Outcomes() <-chan sink.Outcome { return k.outcomes }
func (k *testSink) Retries() int64                { return 0 }
func (k *testSink) Close(time.Duration) error {
	k.once.Do(func() { close(k.outcomes) })
	return nil
}

// fail reports rec failed with class.
func (k *testSink) fail(rec sink.Record, class sink.Class, err error) {
	d := sink.Delivery{Txn: rec.Txn(), Bytes: rec.Size(), Topic: rec.Topic(), Record: rec}
	k.outcomes <- sink.Outcome{Delivery: d, Err: &sink.Error{Class: class, EventID: rec.EventID(), Topic: rec.Topic(),
		OrderMayBreak: true, Record: rec, Err: err}}
}

func (k *testSink) ack(rec sink.Record) {
	k.outcomes <- sink.Outcome{Delivery: sink.Delivery{Txn: rec.Txn(), Bytes: rec.Size(), Topic: rec.Topic(), Record: rec}}
}

// testSource hands the engine one Read, then nothing, and keeps what it
// was told.
type testSource struct {
	read    *Read
	mu      sync.Mutex
	fates   map[Position]Fate
	settled chan Position
}

func newTestSource(rd Read) *testSource {
	return &testSource{read: &rd, fates: map[Position]Fate{}, settled: make(chan Position, 100)}
}

func (s *testSource) Next(ctx context.Context, deadline time.Time) (Read, error) {
	if s.read != nil {
		rd := *s.read
		s.read = nil
		return rd, nil
	}
	select {
	case <-time.After(time.Until(deadline)):
	case <-ctx.Done():
	}
	return Read{}, nil
}
func (s *testSource) Sent(Position, int) {}
func (s *testSource) Settle(pos Position, f Fate) error {
	s.mu.Lock()
	s.fates[pos] = f
	s.mu.Unlock()
	s.settled <- pos
	return nil
}
func (s *testSource) Duties(bool) error   { return nil }
func (s *testSource) Wake() time.Time     { return time.Now().Add(10 * time.Millisecond) }
func (s *testSource) Full() bool          { return false }
func (s *testSource) InTransaction() bool { return false }
func (s *testSource) Close(bool)          {}

// await waits for n settles and returns the fates by position.
func (s *testSource) await(t *testing.T, n int) map[Position]Fate {
	t.Helper()
	for range n {
		select {
		case <-s.settled:
		case <-time.After(10 * time.Second):
			t.Fatalf("settled fewer than %d events", n)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fates
}

type memoryQuarantine struct{ stored chan store.Quarantined }

func (q *memoryQuarantine) Put(_ context.Context, e store.Quarantined) error {
	q.stored <- e
	return nil
}

func testEvent(pos Position, id, aggregate string) *event.Event {
	return &event.Event{Txn: pos, EventID: []byte(id), AggregateType: []byte("order"), AggregateID: []byte(aggregate),
		EventType: []byte("x"), Payload: []byte("{}")}
}

func start(t *testing.T, cfg Config, src Source, snk sink.Sink) {
	t.Helper()
	cfg.Log, cfg.Metrics, cfg.ShutdownTimeout = zerolog.Nop(), pipeline.NewMetrics(nil), time.Second
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- New(cfg, src, snk).Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// A sequence error resets sarama's producer epoch and fails every batch in
// flight, on every partition. The session ends at the first failure; the
// others arrive while its sink closes, and each may break order, so each
// must be counted and logged like the first (a drill caught order broken,
// uncounted, on partitions that were never flagged).
func TestCloseSinkCountsOrderBreaksReportedWhileClosing(t *testing.T) {
	metrics := pipeline.NewMetrics(nil)
	l := New(Config{Log: zerolog.Nop(), Metrics: metrics}, newTestSource(Read{}), nil)
	snk := newTestSink()
	for i, topic := range []string{"outbox.a", "outbox.b"} {
		rec, err := publisher.BuildRecord(testEvent(Position(i), fmt.Sprint("e", i), "1"), topic)
		if err != nil {
			t.Fatal(err)
		}
		snk.fail(rec, sink.ClassProducer, sarama.ErrOutOfOrderSequenceNumber)
	}
	if err := l.closeSink(snk, time.Minute); err != nil {
		t.Fatal(err)
	}
	for _, topic := range []string{"outbox.a", "outbox.b"} {
		if got := counterValue(metrics.OrderBreaks.WithLabelValues(topic, "0")); got != 1 {
			t.Errorf("order breaks counted on %s/0: %v, want 1", topic, got)
		}
	}
}

// A source that reads failed events again later asks that an event that
// cannot be built hold back the rest of its aggregate in the same read:
// they are settled unsent, and the other aggregates' events go.
func TestEventThatCannotBeBuiltHoldsBackItsAggregate(t *testing.T) {
	snk := newTestSink()
	snk.refuse["a1"] = true
	q := &memoryQuarantine{stored: make(chan store.Quarantined, 10)}
	src := newTestSource(Read{HoldAggregates: true, Events: []Event{
		{Event: testEvent(1, "a1", "A"), Hold: "A"},
		{Event: testEvent(2, "b1", "B"), Hold: "B"},
		{Event: testEvent(3, "a2", "A"), Hold: "A"},
		{Event: testEvent(4, "b2", "B"), Hold: "B"},
	}})
	start(t, Config{Quarantine: NewQuarantiner("q", q, 10, "quarantined")}, src, snk)
	var sent []string
	for range 2 {
		it := <-snk.in
		sent = append(sent, it.Record.EventID())
		snk.ack(it.Record)
	}
	if fmt.Sprint(sent) != "[b1 b2]" {
		t.Fatalf("sent %v, want [b1 b2]", sent)
	}
	fates := src.await(t, 4)
	if f := fates[1]; !f.Quarantined || f.Err == nil {
		t.Errorf("a1: %+v, want quarantined", f)
	}
	if e := <-q.stored; e.EventID != "a1" {
		t.Errorf("quarantine stored %s, want a1", e.EventID)
	}
	if f := fates[3]; !f.Unsent {
		t.Errorf("a2: %+v, want unsent behind a1", f)
	}
	for _, pos := range []Position{2, 4} {
		if !fates[pos].Acked {
			t.Errorf("position %d: %+v, want acked", pos, fates[pos])
		}
	}
}

// A retriable failure is settled as failed until the event's last
// attempt, which is quarantined; under halt a permanent failure is settled
// as failed, not quarantined.
func TestLastAttemptIsQuarantinedAndHaltSettlesPermanentFailures(t *testing.T) {
	snk := newTestSink()
	q := &memoryQuarantine{stored: make(chan store.Quarantined, 10)}
	src := newTestSource(Read{Events: []Event{
		{Event: testEvent(1, "early", "A"), Attempts: 1},
		{Event: testEvent(2, "last", "B"), Attempts: 3},
		{Event: testEvent(3, "refused", "C"), Attempts: 1},
	}})
	start(t, Config{Quarantine: NewQuarantiner("q", q, 10, "quarantined"), MaxAttempts: 3, HaltOnPermanent: true}, src, snk)
	for _, class := range []sink.Class{sink.ClassRetriable, sink.ClassRetriable, sink.ClassPermanent} {
		it := <-snk.in
		snk.fail(it.Record, class, errors.New("broker said no"))
	}
	fates := src.await(t, 3)
	if f := fates[1]; f.Quarantined || f.Err == nil || f.Err.Class != sink.ClassRetriable {
		t.Errorf("early attempt: %+v, want failed, retriable", f)
	}
	if f := fates[2]; !f.Quarantined {
		t.Errorf("last attempt: %+v, want quarantined", f)
	}
	if e := <-q.stored; e.EventID != "last" || e.Attempts != 3 {
		t.Errorf("quarantine stored %s after %d attempts, want last after 3", e.EventID, e.Attempts)
	}
	if f := fates[3]; f.Quarantined || f.Err == nil || f.Err.Class != sink.ClassPermanent {
		t.Errorf("refused under halt: %+v, want failed, permanent", f)
	}
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}
