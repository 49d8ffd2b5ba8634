package relay

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// outcome takes one record's result from the sink. Acks and failures come
// here, on the loop's goroutine, in the order the sink reported them.
func (s *readLoop) outcome(o sink.Outcome) {
	s.flushed = false
	if o.KafkaTxn != nil {
		s.delivery.ended(*o.KafkaTxn, s.progress.timeline)
		return
	}
	m := s.metrics
	if o.Err == nil {
		s.tracker.Ack(lsn.TxnID(o.Txn), o.Bytes)
		m.acked(o.Delivery)
		s.report.acked(o.At)
		return
	}
	perr := o.Err
	m.Failed(perr.Class)
	if perr.Class == sink.ClassPermanent && s.quarantine != nil && perr.Record != nil {
		// Still in flight until stored: the tracker confirms nothing after
		// it in WAL order before then. It is not re-delivered, so it
		// cannot land after later events either.
		s.quarantining++
		s.quarantine.put(store.QuarantinedRecord(perr.Record.Shaped(), failure(perr)), perr, lsn.TxnID(o.Txn), o.Bytes)
		return
	}
	s.orderBreak(perr)
	if s.failure == nil {
		// Nothing at or after the failed event is ever confirmed: its
		// transaction never completes in the tracker.
		s.failure = perr
	}
}

// orderBreak counts and logs a failure after which order may break.
// sarama keeps appending later batches to a partition after one failed
// (measured with OUT_OF_ORDER_SEQUENCE_NUMBER), so the re-delivered event
// may land after events committed later. It is safe from any goroutine:
// closeSink calls it from the one that drains an abandoned sink.
func (s *readLoop) orderBreak(perr *sink.Error) {
	if !perr.OrderMayBreak {
		return
	}
	s.metrics.OrderBroke(perr.Topic, perr.Partition)
	s.log.Warn().Str("topic", perr.Topic).Int32("partition", perr.Partition).Str("event_id", perr.EventID).
		Str("class", string(perr.Class)).Err(perr.Err).
		Msg("record failed after reaching its partition: per-aggregate order on this partition may break when it is re-delivered")
}

// closeSink closes a sink while still reading what it reports. Once a
// failure ends the session the loop reads no more outcomes, but the
// producer may fail more records that later ones of their partition have
// already passed (a sequence error resets the producer's epoch and fails
// every batch in flight, on every partition): each must be counted and
// logged as a possible order break like the first.
func (s *readLoop) closeSink(snk sink.Sink, timeout time.Duration) error {
	read := make(chan struct{})
	go func() {
		defer close(read)
		for o := range snk.Outcomes() {
			if o.Err != nil {
				s.orderBreak(o.Err)
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

// stored takes a quarantine write's result: the event now counts as
// delivered, or the session ends for good.
func (s *readLoop) stored(res quarantineResult) {
	perr := res.job.perr
	s.quarantining--
	if res.err != nil {
		if s.failure == nil {
			s.failure = fmt.Errorf("%w %s: %w; %s; event %s (%v) stays unpublished until then",
				pipeline.ErrQuarantineWrite, s.quarantine.table, res.err, store.WriteAdvice(res.err), res.job.event.EventID, perr.Err)
		}
		return
	}
	s.tracker.Ack(res.job.txn, res.job.bytes)
	s.log.Error().Str("event_id", res.job.event.EventID).Str("topic", res.job.event.Topic).Str("class", string(perr.Class)).
		Err(perr.Err).Str("advice", perr.Advice()).
		Msg(s.quarantine.storedMessage)
}

// quarantineWriter stores events Kafka will never accept.
type quarantineWriter interface {
	Put(ctx context.Context, e Quarantined) error
}

// quarantineJob is one event to store, with what to ack once it is stored.
type quarantineJob struct {
	event Quarantined
	perr  *sink.Error
	txn   lsn.TxnID
	bytes int
}

type quarantineResult struct {
	job *quarantineJob
	err error
}

// quarantiner writes quarantined events on its own goroutine, one at a
// time, so the SQL never holds up the read loop or the producer's acks.
// Results come back to the loop over results, in order.
type quarantiner struct {
	table string // for the operator, in errors
	// storedMessage is what the log says of each event stored.
	storedMessage string
	writer        quarantineWriter
	timeout       time.Duration
	jobs          chan *quarantineJob
	results       chan quarantineResult
	quit          chan struct{}
	done          sync.WaitGroup
	stopping      sync.Once
}

// newQuarantiner starts the writer. capacity must exceed the events that
// can be in flight, so the loop never blocks handing over a job. Jobs go
// by pointer because a channel's buffer is allocated whole: by value, the
// exactly-once window's buffer took 14 MB, 43% of the live heap while
// catching up, for jobs that almost never come.
func newQuarantiner(table string, w quarantineWriter, capacity int) *quarantiner {
	q := &quarantiner{
		table: table, writer: w, timeout: 30 * time.Second,
		storedMessage: "event quarantined: Kafka will not accept it; fix the cause, then `outbox-relay quarantine replay`",
		jobs:          make(chan *quarantineJob, capacity), results: make(chan quarantineResult, 1), quit: make(chan struct{}),
	}
	q.done.Add(1)
	go q.run()
	return q
}

func (q *quarantiner) run() {
	defer q.done.Done()
	for job := range q.jobs {
		select {
		case <-q.quit:
			return
		default:
		}
		// Its own context: a shutdown still stores what is in flight.
		ctx, cancel := context.WithTimeout(context.Background(), q.timeout)
		err := q.writer.Put(ctx, job.event)
		cancel()
		select {
		case q.results <- quarantineResult{job, err}:
		case <-q.quit:
			return
		}
	}
}

// put hands an event to the writer.
func (q *quarantiner) put(e Quarantined, perr *sink.Error, txn lsn.TxnID, bytes int) {
	q.jobs <- &quarantineJob{event: e, perr: perr, txn: txn, bytes: bytes}
}

// stop ends the writer once the write under way, if any, is done.
func (q *quarantiner) stop() {
	q.stopping.Do(func() {
		close(q.quit)
		close(q.jobs)
	})
	q.done.Wait()
}

// stopIfStarted stops q when there is one.
func (q *quarantiner) stopIfStarted() {
	if q != nil {
		q.stop()
	}
}
