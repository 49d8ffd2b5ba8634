package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// ReplayResult is the outcome of replaying one quarantined event.
type ReplayResult struct {
	EventID string `json:"event_id"`
	Topic   string `json:"topic"`
	Err     error  `json:"-"` // nil: acknowledged by Kafka and marked replayed
}

// replayOutcomes collects the producer's answer for each replayed event,
// by its record.
type replayOutcomes struct {
	mu      sync.Mutex
	errs    map[sink.Record]error
	topics  map[sink.Record]string
	pending sync.WaitGroup
}

// collect takes a publisher's outcomes, on a goroutine of its own, until
// the publisher closes them.
func (o *replayOutcomes) collect(pub sink.Sink, done *sync.WaitGroup) {
	done.Add(1)
	go func() {
		defer done.Done()
		for out := range pub.Outcomes() {
			o.mu.Lock()
			if out.Err != nil {
				o.errs[out.Record] = out.Err
			} else {
				o.topics[out.Record] = out.Topic
			}
			o.mu.Unlock()
			o.pending.Done()
		}
	}()
}

// await waits, at most timeout, for the outcome of every event sent.
func (o *replayOutcomes) await(ctx context.Context, timeout time.Duration) {
	done := make(chan struct{})
	go func() {
		o.pending.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(timeout):
	case <-ctx.Done():
	}
}

// ErrReplayRefused marks an event replay did not send because its row is
// no event as it stands (content_problem is set); the others go on.
var ErrReplayRefused = errors.New("refused")

// Replay publishes quarantined events again, with their original event_id,
// key and headers, and marks each replayed, with its topic, only after
// Kafka acknowledged it. An event that fails again, or fails the read loop's row
// checks, stays quarantined; a row whose content_problem is set is refused
// (ErrReplayRefused), naming it. A replayed event lands after any later events
// of its aggregate. The layout gives the records their shape, as `run`
// would have.
func Replay(ctx context.Context, sinks Sinks, l *layout.Layout, quarantine *store.Quarantine, events []Quarantined, timeout time.Duration, log zerolog.Logger) ([]ReplayResult, error) {
	out := &replayOutcomes{errs: map[sink.Record]error{}, topics: map[sink.Record]string{}}
	// The collectors end when their publisher's Outcomes closes; a broker
	// that never answers Close may keep one waiting, which must not hold
	// up the replay's answer.
	var collecting sync.WaitGroup
	pub, err := sinks.ConnectWithin(ctx, func() (sink.Sink, error) { return sinks.New(0) })
	if err != nil {
		return nil, err
	}
	out.collect(pub, &collecting)
	results := make([]ReplayResult, len(events))
	sent := make([]sink.Record, len(events))
	for i := range events {
		results[i].EventID = events[i].EventID
		if problem := events[i].ContentProblem; problem != "" {
			// Its columns are not an event as they stand (a content that
			// was no event, values stored escaped or left out): sending
			// them would publish the problem itself.
			results[i].Err = fmt.Errorf("%w: %s; fix the row's columns in the quarantine table (raw holds the content as it arrived) and set content_problem to NULL, then replay it",
				ErrReplayRefused, problem)
			continue
		}
		// The quarantine table cannot hold a NULL (but for the payload of
		// Debezium's layout), so a value the row lacked comes back empty;
		// the row check refuses it like the read loop's.
		ev := event.Restore(&events[i].Stored, l)
		if perr := sink.CheckRow(ev); perr != nil {
			results[i].Err = perr
			continue
		}
		rec, err := sink.BuildWhenReady(ctx, pub.Build, ev)
		var limit *sink.BatchLimitError
		if errors.As(err, &limit) {
			// The topic takes smaller batches: flush what is in flight and
			// go on with a producer built for them.
			out.await(ctx, timeout)
			if cerr := pub.Close(timeout); cerr != nil {
				return nil, cerr
			}
			if pub, err = sinks.New(limit.MaxMessageBytes); err != nil {
				return nil, err
			}
			out.collect(pub, &collecting)
			rec, err = sink.BuildWhenReady(ctx, pub.Build, ev)
		}
		if err != nil {
			results[i].Err = err
			continue
		}
		results[i].Topic = rec.Topic()
		sent[i] = rec
		out.pending.Add(1)
		if err := send(ctx, pub, rec); err != nil {
			out.pending.Done()
			results[i].Err = err
		}
	}
	out.await(ctx, timeout)
	closeErr := pub.Close(5 * time.Second)

	out.mu.Lock()
	defer out.mu.Unlock()
	for i := range results {
		r := &results[i]
		if r.Err != nil {
			continue
		}
		if err, failed := out.errs[sent[i]]; failed {
			r.Err = err
			continue
		}
		if _, acked := out.topics[sent[i]]; !acked {
			r.Err = fmt.Errorf("no acknowledgement from Kafka within %s; the event stays quarantined", timeout)
			continue
		}
		r.Err = quarantine.MarkReplayed(ctx, r.EventID, r.Topic)
	}
	return results, closeErr
}

// send hands a record to the sink, waiting while it is full, until ctx
// ends.
func send(ctx context.Context, s sink.Sink, r sink.Record) error {
	select {
	case s.Input() <- sink.Item{Record: r}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
