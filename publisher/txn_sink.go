package publisher

import (
	"context"
	"errors"
	"math"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// TxnSink puts the exactly-once engine behind the channels a read loop
// selects on, as Publisher does for the at-least-once producer: records go
// in through Input, acks and failures come out of Outcomes, and nothing
// here ever calls into the caller or blocks it on Kafka. A goroutine of its
// own drives the Kafka transactions.
//
// Acks come only once the Kafka transaction holding the record committed,
// so a caller that bounds what is in flight must call Flush when its bound
// is reached: otherwise it waits for acks that only a commit produces.
type TxnSink struct {
	txn *TxnPublisher

	input chan *Record // holds inputQueue records
	flush chan struct{}

	// ends are source-transaction boundaries the loop reported that the
	// driving goroutine has not applied yet. EndTxn never blocks the loop
	// (a commit may be under way), so they queue here instead of on a
	// channel.
	endsMu   sync.Mutex
	ends     []sourceEnd
	endAdded chan struct{}

	// queue holds outcomes until the forwarding goroutine hands them to
	// Outcomes, so the engine never waits for the caller to read.
	queueMu  sync.Mutex
	queue    []Outcome
	queued   chan struct{}
	outcomes chan Outcome

	ctx       context.Context // ends when Close gives up waiting
	cancel    context.CancelFunc
	quit      chan struct{}
	closeOnce sync.Once
	closeErr  error
	driving   sync.WaitGroup
	reporting sync.WaitGroup

	// afterDrain, when set (by tests only), runs on the driving goroutine
	// after it took the queued records and before it applies the
	// boundaries it saw: the moment the loop may hand over more of both.
	afterDrain func()
}

// inputQueue is how many records wait on Input while a commit is under way,
// so the loop reads on instead of stalling on every commit. Measured side
// by side on 300,000-event backlogs: 64 took 100-row transactions from
// 0.83-0.86 to 0.85-0.93 of the at-least-once rate; a batch's worth
// (1,000) reached 0.95-1.00 but cost single-row transactions a third of
// their rate and more CPU per event, the loop running that far ahead.
const inputQueue = 64

// NewTxnSink connects to Kafka, initialises the transactional producer
// (fencing any older producer with the same transactional id) and starts
// the sink's goroutines.
func NewTxnSink(cfg Config, tcfg TxnConfig, log zerolog.Logger) (*TxnSink, error) {
	return newTxnSink(cfg, tcfg, log, nil)
}

func newTxnSink(cfg Config, tcfg TxnConfig, log zerolog.Logger, afterDrain func()) (*TxnSink, error) {
	s := &TxnSink{
		input: make(chan *Record, inputQueue), flush: make(chan struct{}, 1), endAdded: make(chan struct{}, 1),
		queued: make(chan struct{}, 1), outcomes: make(chan Outcome, outcomeBuffer), quit: make(chan struct{}),
		afterDrain: afterDrain,
	}
	txn, err := NewTxn(cfg, tcfg, sinkHandler{s}, log)
	if err != nil {
		return nil, err
	}
	s.txn = txn
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.driving.Add(1)
	go s.drive()
	s.reporting.Add(1)
	go s.forward()
	return s, nil
}

// Build checks an event and builds its record, as TxnPublisher.Build; it
// never blocks.
func (s *TxnSink) Build(ev *Event) (*Record, error) { return s.txn.Build(ev) }

// Input takes built records; see Publisher.Input.
func (s *TxnSink) Input() chan<- *Record { return s.input }

// Outcomes delivers each record's ack, after its Kafka transaction
// committed, or its failure. It is closed by Close.
func (s *TxnSink) Outcomes() <-chan Outcome { return s.outcomes }

// EndTxn marks the end of the source transaction whose records were just
// sent; the Kafka transaction may commit there. It never blocks.
func (s *TxnSink) EndTxn(txn lsn.TxnID, end lsn.LSN, commitTime time.Time) {
	s.endsMu.Lock()
	s.ends = append(s.ends, sourceEnd{txn: txn, end: end, commitTime: commitTime})
	s.endsMu.Unlock()
	signal(s.endAdded)
}

// Flush asks for the open Kafka transaction to commit now, without
// waiting: in the middle of a source transaction that splits it, which is
// counted. The caller calls it when its in-flight limits are full.
func (s *TxnSink) Flush() { signal(s.flush) }

// Retries counts the producer's retries since the sink was made.
func (s *TxnSink) Retries() int64 { return s.txn.Retries() }

// Stats returns the counters of this sink's producer.
func (s *TxnSink) Stats() TxnStats { return s.txn.Stats() }

// Close stops taking records and ends the engine within timeout: a Kafka
// transaction of whole source transactions commits, one ending inside a
// source transaction aborts. Outcomes not read by then are dropped. It must
// not be called while a send on Input may still happen.
func (s *TxnSink) Close(timeout time.Duration) error {
	s.closeOnce.Do(func() { s.closeErr = s.close(timeout) })
	return s.closeErr
}

func (s *TxnSink) close(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	close(s.input)
	driven := make(chan struct{})
	go func() {
		s.driving.Wait()
		close(driven)
	}()
	wait := time.NewTimer(timeout)
	defer wait.Stop()
	select {
	case <-driven:
	case <-wait.C:
		// A commit stuck on a broker that never answers: give it up.
		s.cancel()
	}
	err := s.txn.Close(max(time.Until(deadline), 100*time.Millisecond))
	s.cancel()
	close(s.quit)
	s.reporting.Wait()
	return err
}

// drive applies records, boundaries and flushes to the engine, in the
// order the loop made them, until Input is closed.
func (s *TxnSink) drive() {
	defer s.driving.Done()
	for {
		select {
		case r, ok := <-s.input:
			if !ok {
				s.applyEnds(math.MaxUint64)
				return
			}
			s.take(r)
		case <-s.endAdded:
			if !s.takeReported() {
				return
			}
		case <-s.flush:
			if !s.takeReported() {
				return // Close commits or aborts what is open
			}
			// A failure is reported through the handler already.
			_ = s.txn.Commit(s.ctx)
		}
	}
}

// take applies one record from Input. Boundaries of earlier source
// transactions come first; the one of r's own transaction, if the loop
// already reported it, comes after r.
func (s *TxnSink) take(r *Record) {
	s.applyEnds(lsn.TxnID(r.txn))
	s.send(r)
}

// takeReported applies every boundary reported so far, each after its
// records. The loop sends a source transaction's records before it reports
// the transaction's end, so the records of every boundary seen before the
// queue is drained are in it; boundaries reported while it drains may
// belong to records sent after that, and wait for the next wake-up, which
// their report signals. Applied first, such a boundary would leave its
// records waiting in a Kafka transaction for a boundary that already came:
// on a quiet outbox, until the next event or the broker's abort at its
// timeout. It reports false once Input is closed and empty.
func (s *TxnSink) takeReported() bool {
	s.endsMu.Lock()
	upTo := lsn.TxnID(0)
	if n := len(s.ends); n > 0 {
		upTo = s.ends[n-1].txn + 1
	}
	s.endsMu.Unlock()
	open := s.takeQueued()
	if s.afterDrain != nil {
		s.afterDrain()
	}
	if !open {
		upTo = math.MaxUint64 // closed and drained: every record is in
	}
	s.applyEnds(upTo)
	return open
}

// takeQueued applies the records queued on Input until it is empty; see
// takeReported for which boundaries may follow. It reports false once
// Input is closed and empty.
func (s *TxnSink) takeQueued() bool {
	for {
		select {
		case r, ok := <-s.input:
			if !ok {
				return false
			}
			s.take(r)
		default:
			return true
		}
	}
}

func (s *TxnSink) send(r *Record) {
	joined, err := s.txn.send(s.ctx, r)
	if err != nil && !joined {
		// The engine reports only records that joined a transaction;
		// every record sent on Input must come back once.
		class := ClassRetriable
		if errors.Is(err, ErrFenced) {
			class = ClassFenced
		}
		d := failedDelivery(r)
		s.report(Outcome{Delivery: d, Err: &Error{Class: class, EventID: r.EventID(), Topic: d.Topic, Partition: -1, Err: err}})
	}
}

// applyEnds applies the boundaries of source transactions before upTo.
func (s *TxnSink) applyEnds(upTo lsn.TxnID) {
	for {
		s.endsMu.Lock()
		if len(s.ends) == 0 || s.ends[0].txn >= upTo {
			s.endsMu.Unlock()
			return
		}
		e := s.ends[0]
		s.ends = s.ends[1:]
		s.endsMu.Unlock()
		// A failure is reported through the handler already.
		_ = s.txn.EndTxn(s.ctx, e.txn, e.end, e.commitTime)
	}
}

func (s *TxnSink) report(o Outcome) {
	s.queueMu.Lock()
	s.queue = append(s.queue, o)
	s.queueMu.Unlock()
	signal(s.queued)
}

// forward hands queued outcomes to Outcomes until Close.
func (s *TxnSink) forward() {
	defer s.reporting.Done()
	defer close(s.outcomes)
	var batch []Outcome
	for {
		select {
		case <-s.queued:
		case <-s.quit:
			return
		}
		s.queueMu.Lock()
		batch, s.queue = s.queue, batch[:0]
		s.queueMu.Unlock()
		for _, o := range batch {
			select {
			case s.outcomes <- o:
			case <-s.quit:
				return
			}
		}
	}
}

// sinkHandler turns the engine's handler calls into outcomes.
type sinkHandler struct{ s *TxnSink }

func (h sinkHandler) Acked(d Delivery) { h.s.report(Outcome{Delivery: d}) }

func (h sinkHandler) Failed(d Delivery, err *Error) { h.s.report(Outcome{Delivery: d, Err: err}) }

// signal wakes whoever waits on c, without blocking.
func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}
