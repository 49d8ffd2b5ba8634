package sink

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/event"
)

// Sender sends events through a sink for callers without a loop of their
// own (quarantine replay, reconcile's republish): it checks each row as the
// read loop does, waits for a topic's lookup, makes a new sink when a
// topic asks for smaller batches, and hands every outcome to handle, on a
// goroutine of its own, in the order the sink reports them.
type Sender struct {
	newSink func(batchLimit int) (Sink, error)
	handle  func(Outcome)
	// drainTimeout bounds the wait for the outcomes of what was sent
	// before a sink is replaced.
	drainTimeout time.Duration

	sink       Sink
	pending    sync.WaitGroup // records sent whose outcome is not handled
	collecting sync.WaitGroup // goroutines handing outcomes to handle
}

// NewSender sends through first, and through sinks newSink makes once a
// topic asks for batches of at most batchLimit bytes; before that, it
// waits at most drainTimeout for the outcomes of what it sent.
func NewSender(first Sink, newSink func(batchLimit int) (Sink, error), drainTimeout time.Duration, handle func(Outcome)) *Sender {
	s := &Sender{newSink: newSink, handle: handle, drainTimeout: drainTimeout}
	s.use(first)
	return s
}

// use makes snk the sink records go to, and collects its outcomes until it
// closes them.
func (s *Sender) use(snk Sink) {
	s.sink = snk
	s.collecting.Add(1)
	go func() {
		defer s.collecting.Done()
		for o := range snk.Outcomes() {
			s.handle(o)
			if o.KafkaTxn == nil {
				s.pending.Done()
			}
		}
	}()
}

// Send checks ev, builds its record and sends it, waiting while the sink is
// full. It returns the record sent, or what kept it from being sent: a
// *Error (a row refused for good, by the row checks or the sink's own),
// or ctx's error.
func (s *Sender) Send(ctx context.Context, ev *event.Event) (Record, error) {
	if perr := CheckRow(ev); perr != nil {
		return nil, perr
	}
	rec, err := BuildWhenReady(ctx, s.sink.Build, ev)
	var limit *BatchLimitError
	if errors.As(err, &limit) {
		if err := s.replace(ctx, limit.MaxMessageBytes); err != nil {
			return nil, err
		}
		rec, err = BuildWhenReady(ctx, s.sink.Build, ev)
	}
	if err != nil {
		return nil, err
	}
	s.pending.Add(1)
	select {
	case s.sink.Input() <- Item{Record: rec}:
		return rec, nil
	case <-ctx.Done():
		s.pending.Done()
		return nil, ctx.Err()
	}
}

// replace waits for the outcomes of what was sent, closes the sink, and
// makes one whose batches are at most batchLimit bytes.
func (s *Sender) replace(ctx context.Context, batchLimit int) error {
	s.Wait(ctx, s.drainTimeout)
	if err := s.sink.Close(s.drainTimeout); err != nil {
		return fmt.Errorf("close the producer to make one with smaller batches: %w", err)
	}
	snk, err := s.newSink(batchLimit)
	if err != nil {
		return err
	}
	s.use(snk)
	return nil
}

// Wait waits until every record sent has had its outcome handled, at most
// timeout or until ctx ends, and reports whether they all did.
func (s *Sender) Wait(ctx context.Context, timeout time.Duration) bool {
	done := make(chan struct{})
	go func() {
		s.pending.Wait()
		close(done)
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

// Close closes the sink, flushing for at most timeout; outcomes that come
// after are dropped. It does not wait for a sink that never finishes.
func (s *Sender) Close(timeout time.Duration) error {
	return s.sink.Close(timeout)
}
