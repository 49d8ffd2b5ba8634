package reconcile

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// Outcome of one missing event during republish.
const (
	pending uint8 = iota
	sent
	acked
	quarantinedNow
	failed
)

// republisher sends the missing events through the publisher `run` uses and
// records each one's outcome. Acks and failures arrive on the publisher's
// outcome goroutine, each found in the missing list by its record's event
// id.
type republisher struct {
	missing    sortedIDs
	quarantine *store.Quarantine // nil: permanent errors fail the event
	log        zerolog.Logger

	mu    sync.Mutex
	state []uint8
	errs  map[int]string
	// permanent marks the failures Kafka refused for good.
	permanent map[int]bool
	acks      *counters
}

// indexOf is the place in the missing list of a record's event; only
// events found there are sent.
func (r *republisher) indexOf(rec sink.Record) int {
	id, _ := ParseEventID(rec.Shaped().EventID)
	i, _ := r.missing.index(id)
	return i
}

// outcome takes one record's outcome, on the sender's goroutine.
func (r *republisher) outcome(o sink.Outcome) {
	if o.Err == nil {
		r.mu.Lock()
		r.state[r.indexOf(o.Record)] = acked
		r.mu.Unlock()
		r.acks.done.Add(1)
		return
	}
	perr := o.Err
	if perr.Class == sink.ClassPermanent && perr.Record != nil && r.quarantine != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := r.quarantine.Put(ctx, store.QuarantinedRecord(perr.Record.Shaped(), failure(perr)))
		cancel()
		if err == nil {
			r.quarantined(r.indexOf(o.Record), perr)
			return
		}
		perr = &sink.Error{Class: perr.Class, EventID: perr.EventID, Topic: perr.Topic, Partition: perr.Partition,
			Err: fmt.Errorf("%w; and it could not be quarantined: %v", perr.Err, err)}
	}
	r.fail(r.indexOf(o.Record), sink.Explain(perr), perr.Class == sink.ClassPermanent)
}

// failure is what the quarantine table keeps of why an event failed.
func failure(perr *sink.Error) store.Failure {
	return store.Failure{Topic: perr.Topic, Class: string(perr.Class), Message: sink.Explain(perr)}
}

func (r *republisher) quarantined(i int, perr *sink.Error) {
	r.mu.Lock()
	r.state[i] = quarantinedNow
	r.mu.Unlock()
	r.log.Error().Str("event_id", r.missing[i].String()).Str("topic", perr.Topic).Err(perr.Err).Str("advice", perr.Advice()).
		Msg("event quarantined: Kafka will not accept it; fix the cause, then `outbox-relay quarantine replay`")
}

// fail takes a missing event's failure; permanent says retrying cannot
// fix it.
func (r *republisher) fail(i int, msg string, permanent bool) {
	r.mu.Lock()
	r.state[i] = failed
	r.errs[i] = msg
	if permanent {
		r.permanent[i] = true
	}
	r.mu.Unlock()
}

// republish sends rep.Missing again, oldest row first, and fills in the
// report's republish fields. Only acknowledged events count as republished.
func republish(ctx context.Context, cfg Config, t *table, rep *Report, progress *counters, log zerolog.Logger) error {
	r := &republisher{missing: rep.Missing, log: log, state: make([]uint8, len(rep.Missing)),
		errs: map[int]string{}, permanent: map[int]bool{}, acks: progress}
	if cfg.Republish.Quarantine && cfg.Quarantine.Name != "" {
		q, err := store.OpenQuarantine(ctx, cfg.Postgres, cfg.Quarantine, store.ForRelay)
		if err != nil {
			return err
		}
		defer q.Close()
		r.quarantine = q
	}
	kafka := publisher.NewKafka(cfg.Kafka, log)
	progress.waitOn(fmt.Sprintf("connecting to brokers %v", cfg.Kafka.Brokers))
	first, err := kafka.ConnectWithin(ctx, func() (sink.Sink, error) { return kafka.New(0) })
	if err != nil {
		return err
	}
	progress.waitOn("")
	// A topic that takes smaller batches gets a new producer, as `run`
	// makes, once what was sent is acknowledged.
	sender := sink.NewSender(first, kafka.New, cfg.Republish.AckTimeout, r.outcome)

	err = t.eachWindowRow(ctx, func(ev *event.Event) error {
		id, ok := ParseEventID(ev.EventID)
		if !ok {
			return nil
		}
		i, ok := r.missing.index(id)
		if !ok {
			return nil
		}
		r.mu.Lock()
		state := r.state[i]
		r.state[i] = sent
		r.mu.Unlock()
		if state != pending {
			return nil // the table returned the row twice (a text id without a key)
		}
		_, err := sender.Send(ctx, ev)
		var perr *sink.Error
		switch {
		case errors.As(err, &perr) && perr.Class == sink.ClassPermanent && r.quarantine != nil:
			if qerr := r.quarantine.Put(ctx, store.QuarantinedEvent(ev, failure(perr))); qerr != nil {
				return qerr
			}
			r.quarantined(i, perr)
		case err != nil && ctx.Err() != nil:
			return ctx.Err()
		case err != nil:
			r.fail(i, sink.Explain(err), errors.As(err, &perr) && perr.Class == sink.ClassPermanent)
		}
		return nil
	})
	if err == nil {
		progress.waitOn("acknowledgements of the events sent")
		if !sender.Wait(ctx, cfg.Republish.AckTimeout) {
			if err = ctx.Err(); err == nil {
				log.Warn().Dur("ack_timeout", cfg.Republish.AckTimeout).Msg("gave up waiting for Kafka's acknowledgements")
			}
		}
	}
	if cerr := sender.Close(5 * time.Second); cerr != nil {
		log.Warn().Err(cerr).Msg("closing the producer")
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	for i, s := range r.state {
		switch s {
		case acked:
			rep.Republished++
		case quarantinedNow:
			rep.RepublishQuarantined = append(rep.RepublishQuarantined, r.missing[i])
		case failed:
			rep.RepublishFailed = append(rep.RepublishFailed, Failure{EventID: r.missing[i], Error: r.errs[i], Permanent: r.permanent[i]})
		case sent:
			rep.RepublishFailed = append(rep.RepublishFailed, Failure{EventID: r.missing[i],
				Error: "no acknowledgement from Kafka in time; run reconcile again"})
		case pending:
			rep.RepublishFailed = append(rep.RepublishFailed, Failure{EventID: r.missing[i],
				Error: "the row left the window or the table before it was sent"})
		}
	}
	return err
}
