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

// ErrReplayRefused marks an event replay did not send because its row is
// no event as it stands (content_problem is set); the others go on.
var ErrReplayRefused = errors.New("refused")

// Replay publishes quarantined events again, with their original event_id,
// key and headers, and marks each replayed, with its topic, only after
// Kafka acknowledged it. An event that fails again, or fails the engine's row
// checks, stays quarantined; a row whose content_problem is set is refused
// (ErrReplayRefused), naming it. A replayed event lands after any later events
// of its aggregate. The layout gives the records their shape, as `run`
// would have.
func Replay(ctx context.Context, sinks Sinks, l *layout.Layout, quarantine *store.Quarantine, events []Quarantined, timeout time.Duration, log zerolog.Logger) ([]ReplayResult, error) {
	var mu sync.Mutex
	errs, topics := map[sink.Record]error{}, map[sink.Record]string{}
	collect := func(o sink.Outcome) {
		mu.Lock()
		defer mu.Unlock()
		if o.Err != nil {
			errs[o.Record] = o.Err
		} else {
			topics[o.Record] = o.Topic
		}
	}
	first, err := sinks.ConnectWithin(ctx, func() (sink.Sink, error) { return sinks.New(0) })
	if err != nil {
		return nil, err
	}
	sender := sink.NewSender(first, sinks.New, timeout, collect)
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
		// the sender's row check refuses it like the engine's.
		rec, err := sender.Send(ctx, event.Restore(&events[i].Stored, l))
		if err != nil {
			results[i].Err = err
			continue
		}
		results[i].Topic = rec.Topic()
		sent[i] = rec
	}
	sender.Wait(ctx, timeout)
	closeErr := sender.Close(5 * time.Second)

	mu.Lock()
	defer mu.Unlock()
	for i := range results {
		r := &results[i]
		if r.Err != nil {
			continue
		}
		if err, failed := errs[sent[i]]; failed {
			r.Err = err
			continue
		}
		if _, acked := topics[sent[i]]; !acked {
			r.Err = fmt.Errorf("no acknowledgement from Kafka within %s; the event stays quarantined", timeout)
			continue
		}
		r.Err = quarantine.MarkReplayed(ctx, r.EventID, r.Topic)
	}
	return results, closeErr
}
