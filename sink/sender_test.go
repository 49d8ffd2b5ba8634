package sink_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/sink"
)

// batchSink acks every record; made with no batch limit, it refuses to
// build with a *sink.BatchLimitError, as the Kafka sink does for a topic
// that takes smaller batches.
type batchSink struct {
	limit    int
	in       chan sink.Item
	outcomes chan sink.Outcome
	closed   bool
}

type record struct{ id string }

func (r *record) Topic() string         { return "t" }
func (r *record) EventID() string       { return r.id }
func (r *record) Size() int             { return 1 }
func (r *record) Txn() uint64           { return 0 }
func (r *record) Shaped() *event.Record { return &event.Record{} }

func newBatchSink(limit int) *batchSink {
	s := &batchSink{limit: limit, in: make(chan sink.Item), outcomes: make(chan sink.Outcome, 16)}
	go func() {
		defer close(s.outcomes)
		for it := range s.in {
			s.outcomes <- sink.Outcome{Delivery: sink.Delivery{Topic: "t", Record: it.Record}}
		}
	}()
	return s
}

func (s *batchSink) Build(ev *event.Event) (sink.Record, error) {
	if s.limit == 0 {
		return nil, &sink.BatchLimitError{Topic: "t", MaxMessageBytes: 500}
	}
	return &record{id: string(ev.EventID)}, nil
}
func (s *batchSink) Input() chan<- sink.Item       { return s.in }
func (s *batchSink) Outcomes() <-chan sink.Outcome { return s.outcomes }
func (s *batchSink) Retries() int64                { return 0 }
func (s *batchSink) Close(time.Duration) error {
	if !s.closed {
		s.closed = true
		close(s.in)
	}
	return nil
}

// The sender refuses a row the engine would refuse before building
// it, makes a sink with the batch limit a topic asks for, and hands every
// outcome over before Wait returns.
func TestSenderRemakesTheSinkWithTheBatchLimitAsked(t *testing.T) {
	first := newBatchSink(0)
	var made []int
	newSink := func(limit int) (sink.Sink, error) {
		made = append(made, limit)
		return newBatchSink(limit), nil
	}
	var mu sync.Mutex
	var acked []string
	s := sink.NewSender(first, newSink, 10*time.Second, func(o sink.Outcome) {
		mu.Lock()
		defer mu.Unlock()
		if o.Err == nil {
			acked = append(acked, o.Record.EventID())
		}
	})
	ctx := context.Background()
	ev := func(id string, aggregateID string) *event.Event {
		return &event.Event{EventID: []byte(id), AggregateID: []byte(aggregateID), AggregateType: []byte("order"),
			EventType: []byte("Placed"), Payload: []byte("{}")}
	}
	var perr *sink.Error
	if _, err := s.Send(ctx, ev("e0", "")); !errors.As(err, &perr) || perr.Class != sink.ClassPermanent {
		t.Fatalf("a row with no aggregate_id: %v, want refused for good", err)
	}
	for _, id := range []string{"e1", "e2"} {
		if _, err := s.Send(ctx, ev(id, "o-1")); err != nil {
			t.Fatal(err)
		}
	}
	if !s.Wait(ctx, 10*time.Second) {
		t.Fatal("outcomes missing")
	}
	if err := s.Close(time.Second); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(made) != 1 || made[0] != 500 || !first.closed || len(acked) != 2 || acked[0] != "e1" || acked[1] != "e2" {
		t.Fatalf("sinks made with limits %v (first closed: %t), acked %v; want one with 500, and e1, e2 acked", made, first.closed, acked)
	}
}
