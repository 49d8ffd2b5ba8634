// Package engine publishes what a source reads. One loop, the same for the
// WAL, messages and poll sources, builds each event's record, sends it to
// the sink under the source's in-flight limits, takes the outcomes,
// quarantines what the sink will never accept, rides out a Kafka outage,
// and settles every event's position back to the source, which alone
// knows how to make it durable (a slot's confirmed LSN, a marked row).
package engine

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// Position is where a source read an event, as only the source reads it.
// It travels as the event's Txn, so the sink's outcome names it again.
type Position = uint64

// Source reads events and makes positions durable once they are settled.
// The engine calls it from its own goroutine only.
type Source interface {
	// Next returns what was read next, waiting until deadline at most; a
	// Read with no event and no end means nothing came.
	Next(ctx context.Context, deadline time.Time) (Read, error)
	// Sent says the event at pos goes to the sink as a record of bytes, or
	// to the quarantine (0): called at most once per event, before it
	// goes. An event is the source's to count from when it was read.
	Sent(pos Position, bytes int)
	// Settle says what became of an event. An error ends the session: the
	// source then reads again from what it made durable.
	Settle(pos Position, f Fate) error
	// Duties are the source's own work on every turn of the loop (report
	// positions, take its helpers' failures); force reports now.
	Duties(force bool) error
	// Wake is when Duties is due again even if nothing happens.
	Wake() time.Time
	// Full says the source's in-flight limits are reached: the engine
	// reads nothing more until settles free room.
	Full() bool
	// InTransaction says a source transaction is open: a stop reads on to
	// its end, so what was sent of it can be settled.
	InTransaction() bool
	// Close ends the source; graceful lets it record its last position.
	Close(graceful bool)
}

// Read is what a source read: events to publish in order, then possibly
// the end of a source transaction.
type Read struct {
	Events []Event
	// End is the end of a source transaction; a transactional sink closes
	// its own there.
	End *sink.SourceEnd
	// HoldAggregates: once an event cannot be built, the later events of
	// its aggregate in this Read are not sent but settled Unsent. A source
	// that re-reads failed events later asks for it, so an aggregate's
	// events go in order.
	HoldAggregates bool
}

// Event is one event to publish, at Event.Txn's position.
type Event struct {
	*event.Event
	// Refused is set when the source itself found the event unpublishable
	// (a *sink.Error of class permanent): it is quarantined unsent.
	Refused error
	// Keep adds to a quarantined event what the source holds of its raw
	// form; nil: nothing.
	Keep func(q *store.Quarantined)
	// Attempts is how often the event was sent, this time included (0:
	// the source does not count); at Config.MaxAttempts a retriable
	// failure quarantines it.
	Attempts int
	// Hold is the event's aggregate, for Read.HoldAggregates.
	Hold string
}

// Fate is what became of one event.
type Fate struct {
	// Acked: the sink stored it, as Delivery says.
	Acked    bool
	Delivery sink.Delivery
	// Quarantined: the quarantine table holds it, for Err.
	Quarantined bool
	// Err is why it failed (with Quarantined: why it was quarantined).
	Err *sink.Error
	// Unsent: it was never sent, or no outcome came before a stop.
	Unsent bool
	// Bytes are those Sent said.
	Bytes int
}

// Config is what every session's loop is run with.
type Config struct {
	Log     zerolog.Logger
	Metrics *pipeline.Metrics
	Clock   pipeline.Clock
	// Alive tells the watchdog the loop turns (nil: none watches).
	Alive func()
	// ShutdownTimeout bounds the wait for outcomes on a stop, and the read
	// on to the end of an open source transaction.
	ShutdownTimeout time.Duration
	// BackoffMin and BackoffMax space the attempts to reach Kafka again.
	BackoffMin, BackoffMax time.Duration
	// Transactional: the sink writes transactions. It gets every source
	// transaction's end and a flush when the source is full.
	Transactional bool
	// MaxAttempts quarantines an event whose retriable failure was its
	// MaxAttempts-th attempt (Event.Attempts); 0: never.
	MaxAttempts int
	// Quarantine keeps events the sink will never accept; nil: such an
	// event is settled as failed, and the source decides.
	Quarantine *Quarantiner
	// HaltOnPermanent settles an event the sink will never accept as
	// failed even with a Quarantine, which then keeps only the events
	// that ran out of attempts (--on-permanent-error halt).
	HaltOnPermanent bool
	// NewSink makes a sink to learn when Kafka is back after a failure;
	// nil: a Kafka failure ends the session at once.
	NewSink func() (sink.Sink, error)
	// OnKafkaTxn takes a transactional sink's report of a Kafka
	// transaction's end.
	OnKafkaTxn func(sink.TxnReport)
	// OnPause is told when the loop stops reading to wait for Kafka;
	// OnDrain when it drains for a stop. Either may be nil.
	OnPause func(at time.Time, cause error)
	OnDrain func()
}

// Loop is one session's publish loop. It alone touches the source and the
// sink: outcomes and quarantine results come to it over channels, and it
// waits for them in its own select, so nothing downstream calls back.
type Loop struct {
	cfg  Config
	log  zerolog.Logger
	src  Source
	sink sink.Sink

	timer        pipeline.Timer
	inFlight     int // events sent or quarantining, not yet settled
	quarantining int // events handed to the quarantine writer, not yet stored
	// unstored are the quarantine jobs of records that failed after
	// reaching their partition (OrderMayBreak), until stored: one that
	// never gets to the table is delivered again, maybe after later
	// records of its partition, and close counts it as an order break.
	unstored []*quarantineJob
	flushed  bool // a flush went to the sink since its last outcome
	failure  error
	finishBy time.Time // set when a stop came inside a source transaction
	// retried are the attempts of the events in flight that were sent
	// before or are at their last, by position: what the quarantine
	// keeps, and whether it is the last.
	retried map[Position]int
	held    map[string]bool
	retries int64 // the sink's retries already taken
	// abandoned: waitForKafka handed the sink to a goroutine that closes
	// it, so close must not close it again (sarama's client panics on a
	// second, concurrent close).
	abandoned bool
	closing   sync.WaitGroup // abandoned sinks being closed
}

// New makes a session's loop on src and snk.
func New(cfg Config, src Source, snk sink.Sink) *Loop {
	if cfg.Clock == nil {
		cfg.Clock = pipeline.WallClock{}
	}
	l := &Loop{cfg: cfg, log: cfg.Log, src: src, sink: snk, timer: cfg.Clock.NewTimer(time.Hour)}
	// Armed only while the loop waits: a test's clock tells a wait by it.
	l.timer.Stop()
	return l
}

// TakeRetries returns the sink's retries since the last call.
func (l *Loop) TakeRetries() int64 {
	r := l.sink.Retries()
	if r <= l.retries {
		return 0
	}
	n := r - l.retries
	l.retries = r
	return n
}

// Run runs the loop, then ends the session: a drain when ctx ended it;
// after a Kafka failure, a wait for Kafka with the source kept open; an
// abandon otherwise.
func (l *Loop) Run(ctx context.Context) error {
	err := l.run(ctx)
	if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		return l.drain()
	}
	if l.kafkaRecoverable(err) {
		werr := l.waitForKafka(ctx, err)
		if ctx.Err() != nil {
			return l.drain()
		}
		if werr == nil {
			// Kafka is back: end the source cleanly, and the next session
			// reads again from what was made durable.
			l.close(l.src.Duties(true) == nil)
			return err
		}
		err = werr
	}
	l.close(false)
	return err
}

func (l *Loop) run(ctx context.Context) error {
	for {
		if err := l.stopRequested(ctx); err != nil {
			return err
		}
		if err := l.takeOutcomes(); err != nil {
			return err
		}
		if err := l.duties(); err != nil {
			return err
		}
		if l.src.Full() {
			// Read nothing until settles free room; the wait wakes for
			// the source's duties too. A transactional sink acks only once
			// it commits, so it is asked, once, to commit now rather than
			// at its interval.
			var flush *sink.Item
			if l.cfg.Transactional && !l.flushed {
				flush = &sink.Item{Flush: true}
			}
			sent, err := l.wait(ctx, flush, nil)
			if err != nil {
				return err
			}
			l.flushed = l.flushed || sent
			continue
		}
		rd, err := l.src.Next(ctx, l.src.Wake())
		if err != nil {
			return err
		}
		if err := l.publish(ctx, rd); err != nil {
			return err
		}
	}
}

// stopRequested returns ctx's error once the session should stop. When ctx
// ends inside a source transaction, the loop first reads on to its end,
// for at most ShutdownTimeout: the events of it already sent can then be
// settled, and a clean stop leaves nothing to re-deliver.
func (l *Loop) stopRequested(ctx context.Context) error {
	err := ctx.Err()
	if err == nil || !l.src.InTransaction() {
		return err
	}
	now := l.cfg.Clock.Now()
	if l.finishBy.IsZero() {
		l.finishBy = now.Add(l.cfg.ShutdownTimeout)
		l.log.Info().Msg("stopping: reading on to the end of the open transaction so what was sent of it can be confirmed")
	} else if now.After(l.finishBy) {
		return err
	}
	return nil
}

// duties are what the loop owes on every turn, however it waits.
func (l *Loop) duties() error {
	if err := l.src.Duties(false); err != nil {
		return err
	}
	if l.cfg.Alive != nil {
		l.cfg.Alive()
	}
	return nil
}

// wait blocks until something needs the loop: item accepted by the sink
// (when item is given), an outcome, a quarantine result, ready closed, the
// source's next wake-up, or ctx ending. It reports whether item was sent,
// and the session-ending failure if one arrived.
func (l *Loop) wait(ctx context.Context, item *sink.Item, ready <-chan struct{}) (sent bool, err error) {
	var in chan<- sink.Item
	var it sink.Item
	if item != nil {
		in, it = l.sink.Input(), *item
	}
	l.timer.Reset(max(l.src.Wake().Sub(l.cfg.Clock.Now()), 0))
	// Stopped again on the way out, so an armed timer means a wait is on.
	defer l.timer.Stop()
	var stop <-chan struct{}
	if l.finishBy.IsZero() {
		stop = ctx.Done() // once finishing a transaction, stop was seen
	}
	select {
	case in <- it:
		sent = true
	case o, ok := <-l.sink.Outcomes():
		if !ok {
			return false, errors.New("kafka producer stopped reporting outcomes")
		}
		l.outcome(o)
	case res := <-l.quarantineResults():
		l.stored(res)
	case <-ready:
	case <-l.timer.C():
	case <-stop:
	}
	if l.failure != nil {
		return sent, l.failure
	}
	return sent, l.stopRequested(ctx)
}

func (l *Loop) quarantineResults() <-chan quarantineResult {
	if l.cfg.Quarantine == nil {
		return nil
	}
	return l.cfg.Quarantine.results
}

// takeOutcomes handles every outcome and quarantine result already there,
// without waiting.
func (l *Loop) takeOutcomes() error {
	stored := l.quarantineResults()
	for {
		select {
		case o, ok := <-l.sink.Outcomes():
			if !ok {
				return errors.New("kafka producer stopped reporting outcomes")
			}
			l.outcome(o)
		case res := <-stored:
			l.stored(res)
		default:
			return l.failure
		}
	}
}

// publish builds and sends what a source read, in order. The events may
// alias the source's read buffer, which stays valid because nothing is
// read until they are sent.
func (l *Loop) publish(ctx context.Context, rd Read) error {
	if rd.HoldAggregates {
		clear(l.held)
	}
	for i := range rd.Events {
		ev := &rd.Events[i]
		if rd.HoldAggregates && l.held[ev.Hold] {
			if err := l.settle(ev.Txn, Fate{Unsent: true}); err != nil {
				l.unsent(rd.Events[i+1:])
				return err
			}
			continue
		}
		if err := l.publishOne(ctx, ev, rd.HoldAggregates); err != nil {
			l.unsent(rd.Events[i+1:])
			return err
		}
	}
	if rd.End == nil || !l.cfg.Transactional {
		return nil
	}
	return l.sendEnd(ctx, rd.End)
}

// unsent settles the rest of a read that the session ends before sending:
// the source reads them again, and a source that was never told would
// wait for them.
func (l *Loop) unsent(evs []Event) {
	for i := range evs {
		l.src.Settle(evs[i].Txn, Fate{Unsent: true})
	}
}

func (l *Loop) publishOne(ctx context.Context, ev *Event, hold bool) error {
	rec, own, err := l.build(ctx, ev)
	if err == nil {
		l.src.Sent(ev.Txn, rec.Size())
		l.inFlight++
		if ev.Attempts > 1 || l.cfg.MaxAttempts > 0 && ev.Attempts >= l.cfg.MaxAttempts {
			if l.retried == nil {
				l.retried = map[Position]int{}
			}
			l.retried[ev.Txn] = ev.Attempts
		}
		if sent, err := l.send(ctx, sink.Item{Record: rec}); err != nil {
			if sent {
				// A stop or a failure came with the sink taking it: it is
				// in flight, and its outcome settles it.
				return err
			}
			l.inFlight--
			delete(l.retried, ev.Txn)
			l.src.Settle(ev.Txn, Fate{Unsent: true, Bytes: rec.Size()})
			return err
		}
		return nil
	}
	var perr *sink.Error
	if !own || !errors.As(err, &perr) || perr.Class != sink.ClassPermanent {
		l.src.Settle(ev.Txn, Fate{Unsent: true})
		return err
	}
	l.cfg.Metrics.Failed(perr.Class)
	if hold {
		if l.held == nil {
			l.held = map[string]bool{}
		}
		l.held[ev.Hold] = true
	}
	if l.cfg.Quarantine == nil || l.cfg.HaltOnPermanent {
		return l.settle(ev.Txn, Fate{Err: perr})
	}
	// Never sent: it is in flight until the quarantine table holds it, so
	// the source makes nothing after it durable before that.
	l.src.Sent(ev.Txn, 0)
	l.inFlight++
	q := store.QuarantinedEvent(ev.Event, failure(perr))
	q.Attempts = ev.Attempts
	if ev.Keep != nil {
		ev.Keep(&q)
	}
	l.quarantine(q, perr, ev.Txn, 0, ev.Attempts)
	return nil
}

// build checks the event's required values, then builds its record,
// waiting, with the loop's duties kept, while the sink looks up its topic.
// own says err is the event's own refusal. A failure that ends the session
// while it waits is not, even another record's permanent one (under halt
// a source returns that record's error), and must not be counted, held or
// settled as this event's.
func (l *Loop) build(ctx context.Context, ev *Event) (rec sink.Record, own bool, err error) {
	if ev.Refused != nil {
		return nil, true, ev.Refused
	}
	if perr := sink.CheckRow(ev.Event); perr != nil {
		return nil, true, perr
	}
	rec, err = l.sink.Build(ev.Event)
	var pending *sink.TopicPendingError
	for errors.As(err, &pending) {
		if _, err := l.wait(ctx, nil, pending.Done); err != nil {
			return nil, false, err
		}
		if err := l.duties(); err != nil {
			return nil, false, err
		}
		select {
		case <-pending.Done:
			rec, err = l.sink.Build(ev.Event)
		default:
		}
	}
	return rec, true, err
}

// send hands an item to the sink, keeping the loop's duties while the sink
// is full. It reports whether the sink took the item, which it may have
// done even when an error ends the wait.
func (l *Loop) send(ctx context.Context, it sink.Item) (sent bool, err error) {
	select {
	case l.sink.Input() <- it:
		return true, nil
	default:
	}
	for {
		sent, err := l.wait(ctx, &it, nil)
		if sent || err != nil {
			return sent, err
		}
		if err := l.duties(); err != nil {
			return false, err
		}
	}
}

// sendEnd hands the sink a source transaction's end once the quarantine
// writer has stored every event handed to it (awaitQuarantined). An
// outcome taken while the end waits for room in the sink may hand it
// another, so the end is offered again only after that one is stored too.
func (l *Loop) sendEnd(ctx context.Context, end *sink.SourceEnd) error {
	it := sink.Item{End: end}
	for {
		if err := l.awaitQuarantined(ctx); err != nil {
			return err
		}
		select {
		case l.sink.Input() <- it:
			return nil
		default:
		}
		sent, err := l.wait(ctx, &it, nil)
		if sent || err != nil {
			return err
		}
		if err := l.duties(); err != nil {
			return err
		}
	}
}

// awaitQuarantined waits, keeping the loop's duties, until the events
// handed to the quarantine writer are stored, before a source transaction
// ends in a transactional sink: the end lets the sink commit a progress
// record past the transaction, and a crash after that commit but before
// the write would lose an event that is neither in Kafka nor in the
// quarantine table. Otherwise the source makes nothing durable past an
// event before it is settled anyway.
func (l *Loop) awaitQuarantined(ctx context.Context) error {
	for l.quarantining > 0 {
		if _, err := l.wait(ctx, nil, nil); err != nil {
			return err
		}
		if err := l.duties(); err != nil {
			return err
		}
	}
	return nil
}

// settle tells the source what became of an event; a source's error
// becomes the session's failure.
func (l *Loop) settle(pos Position, f Fate) error {
	err := l.src.Settle(pos, f)
	if err != nil && l.failure == nil {
		l.failure = err
	}
	return err
}

// outcome takes one record's result from the sink, on the loop's
// goroutine, in the order the sink reported them.
func (l *Loop) outcome(o sink.Outcome) {
	l.flushed = false
	if o.KafkaTxn != nil {
		if l.cfg.OnKafkaTxn != nil {
			l.cfg.OnKafkaTxn(*o.KafkaTxn)
		}
		return
	}
	attempts, retried := l.retried[o.Txn]
	if retried {
		delete(l.retried, o.Txn)
	}
	last := l.cfg.MaxAttempts > 0 && attempts >= l.cfg.MaxAttempts
	if o.Err == nil {
		l.inFlight--
		l.settle(o.Txn, Fate{Acked: true, Delivery: o.Delivery, Bytes: o.Bytes})
		return
	}
	perr := o.Err
	if errors.Is(perr, sink.ErrTopicPartitions) {
		// The topic has fewer partitions than its keys are mapped by (made
		// again smaller): no retry, backoff or quarantine can help, and the
		// session ends with the topic's own error, which every source
		// takes as fatal (pipeline.IsFatal). The event is read again by the
		// next start.
		l.inFlight--
		l.settle(o.Txn, Fate{Unsent: true, Bytes: o.Bytes})
		if l.failure == nil {
			l.failure = perr.Err
		}
		return
	}
	if errors.Is(perr, sink.ErrTopicGone) {
		// The topic was deleted since the session looked it up: backing
		// the event off, or quarantining it, in this session would never
		// look again. The session ends, and the next one looks the topic
		// up: one the relay published to before is waited for.
		l.cfg.Metrics.Failed(perr.Class)
		l.inFlight--
		l.settle(o.Txn, Fate{Unsent: true, Bytes: o.Bytes})
		l.orderBreak(perr)
		if l.failure == nil {
			l.failure = perr
		}
		return
	}
	l.cfg.Metrics.Failed(perr.Class)
	permanent := perr.Class == sink.ClassPermanent
	if l.cfg.Quarantine != nil && perr.Record != nil &&
		(permanent && !l.cfg.HaltOnPermanent || last && !permanent && perr.Class != sink.ClassFenced) {
		// Still in flight until stored: the source makes nothing after it
		// durable before then. Once stored it is not re-delivered, so it
		// cannot land after later events either; one that is not stored
		// before the session ends counts as an order break (close).
		q := store.QuarantinedRecord(perr.Record.Shaped(), failure(perr))
		q.Attempts = attempts
		l.quarantine(q, perr, o.Txn, o.Bytes, attempts)
		return
	}
	l.inFlight--
	if err := l.settle(o.Txn, Fate{Err: perr, Bytes: o.Bytes}); err != nil {
		// The source reads again from what it made durable, so this event
		// is sent again after those of its partition that passed it.
		l.orderBreak(perr)
	}
}

// orderBreak counts and logs a failure after which order may break.
// sarama keeps appending later batches to a partition after one failed
// (measured with OUT_OF_ORDER_SEQUENCE_NUMBER), so the re-delivered event
// may land after events committed later. It is safe from any goroutine:
// closeSink calls it from the one that drains an abandoned sink.
func (l *Loop) orderBreak(perr *sink.Error) {
	if !perr.OrderMayBreak {
		return
	}
	l.cfg.Metrics.OrderBroke(perr.Topic, perr.Partition)
	l.log.Warn().Str("topic", perr.Topic).Int32("partition", perr.Partition).Str("event_id", perr.EventID).
		Str("class", string(perr.Class)).Err(perr.Err).
		Msg("record failed after reaching its partition: per-aggregate order on this partition may break when it is re-delivered")
}

// failure is what the quarantine table keeps of why an event failed.
func failure(perr *sink.Error) store.Failure {
	return store.Failure{Topic: perr.Topic, Class: string(perr.Class), Message: sink.Explain(perr)}
}

// drain ends a session on a stop: read nothing more, wait (bounded) for
// the outcomes of what is in flight, settle what they allow, and close.
func (l *Loop) drain() error {
	if l.cfg.OnDrain != nil {
		l.cfg.OnDrain()
	}
	deadline := l.cfg.Clock.Now().Add(l.cfg.ShutdownTimeout)
	if !l.finishBy.IsZero() {
		// Reading on to a transaction's end already used part of the same
		// timeout.
		deadline = l.finishBy
	}
	for l.inFlight > 0 && l.cfg.Clock.Now().Before(deadline) && l.failure == nil {
		if _, err := l.wait(context.Background(), nil, nil); err != nil {
			break
		}
		if err := l.src.Duties(false); err != nil {
			break
		}
	}
	if l.inFlight > 0 {
		l.log.Warn().Int("in_flight_events", l.inFlight).
			Msg("shutdown timeout reached with events unacknowledged; they will be re-delivered on the next start")
	}
	err := l.src.Duties(true)
	l.close(err == nil)
	return err
}

// close ends the session's parts.
func (l *Loop) close(graceful bool) {
	l.timer.Stop()
	l.src.Close(graceful)
	if !l.abandoned {
		if err := l.closeSink(l.sink, 5*time.Second); err != nil {
			l.log.Warn().Err(err).Msg("abandoned the session's producer")
		}
	}
	if l.cfg.Quarantine != nil {
		l.cfg.Quarantine.stop()
	}
	// The writer has stopped: what it did not report stored is delivered
	// again, and may land after later records of its partition.
	for _, job := range l.unstored {
		l.orderBreak(job.perr)
	}
	l.unstored = nil
	l.closing.Wait()
}

// closeSink closes a sink while still reading what it reports. Once a
// failure ends the session the loop reads no more outcomes, but the
// producer may fail more records that later ones of their partition have
// already passed (a sequence error resets the producer's epoch and fails
// every batch in flight, on every partition): each must be counted and
// logged as a possible order break like the first.
func (l *Loop) closeSink(snk sink.Sink, timeout time.Duration) error {
	read := make(chan struct{})
	go func() {
		defer close(read)
		for o := range snk.Outcomes() {
			if o.Err != nil {
				l.orderBreak(o.Err)
			}
		}
	}()
	err := snk.Close(timeout)
	wait := time.NewTimer(timeout)
	defer wait.Stop()
	select {
	case <-read:
	case <-wait.C: // a producer that never finishes must not hold the session
	}
	return err
}
