package publisher

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/sink"
)

// TxnSink is the exactly-once sink, behind the same channels as Publisher:
// items go in through Input in WAL order, and outcomes come out of
// Outcomes, the end of each Kafka transaction among them. Nothing here
// calls into the caller or blocks it on Kafka.
//
// One goroutine owns all of its state. It waits on the caller's items, the
// producer's acks and errors, the result of the commit or abort under way,
// and its timer. Only the blocking CommitTxn or AbortTxn call runs on a
// goroutine of its own, one at a time, whose result comes back as a
// message.
//
// Acks come only once the Kafka transaction holding the record committed.
// After any failure the sink is spent: every later record is reported
// failed, and the caller closes it and re-streams with a new one. It must
// re-stream from the progress record read back from Kafka with
// read_committed, not from what this sink reported: when a commit's answer
// is lost, the transaction may have committed although the sink reports its
// records failed, and only the progress record, committed with them, tells.
type TxnSink struct {
	cfg      TxnConfig
	log      zerolog.Logger
	topics   *topicResolver
	admin    sarama.ClusterAdmin
	producer sarama.AsyncProducer
	retries  atomic.Int64

	items    chan sink.Item
	outcomes chan sink.Outcome
	closeBy  time.Time     // set by Close before it closes stop and items
	stop     chan struct{} // closed by Close: finish within closeBy
	done     chan struct{} // closed once the producer is closed
	closing  sync.Once
}

// inputQueue is how many items wait on Input while a commit is under way,
// so the loop reads on instead of stalling on every commit. Measured side
// by side on 300,000-event backlogs with the earlier sink: 64 took 100-row
// transactions from 0.83-0.86 to 0.85-0.93 of the at-least-once rate on
// kfake; a batch's worth (1,000) cost single-row transactions a third of
// their rate. With this sink on Apache Kafka, 2,048 changed nothing
// (0.82 and 0.95 against 0.87 and 0.96, one run).
const inputQueue = 64

// NewTxnSink connects to Kafka, initialises the transactional producer
// (which fences any older producer with the same transactional id and
// aborts its open transaction) and starts the sink's goroutine.
func NewTxnSink(cfg Config, tcfg TxnConfig, log zerolog.Logger) (*TxnSink, error) {
	if tcfg.TransactionalID == "" {
		return nil, errors.New("exactly-once delivery needs a transactional id: set --transactional-id or let the relay derive it from the slot")
	}
	tcfg = tcfg.withDefaults()
	template, err := parseTopicTemplate(cfg.TopicTemplate)
	if err != nil {
		return nil, err
	}
	sc, err := saramaConfig(cfg)
	if err != nil {
		return nil, err
	}
	sc.Producer.Transaction.ID = tcfg.TransactionalID
	sc.Producer.Transaction.Timeout = tcfg.Timeout
	// A record that cannot be written within MaxAge fails, which aborts
	// the transaction and re-streams it: in this mode that duplicates
	// nothing, while a longer wait would only meet the coordinator's own
	// timeout abort.
	sc.Producer.Retry.Max = retriesWithin(cfg.RetryBackoffMax, tcfg.MaxAge)
	s := &TxnSink{
		cfg: tcfg, log: log,
		items: make(chan sink.Item, inputQueue), outcomes: make(chan sink.Outcome, outcomeBuffer),
		done: make(chan struct{}), stop: make(chan struct{}),
	}
	// sarama treats a fatal AddPartitionsToTxn answer (PRODUCER_FENCED
	// among them) like a broken connection and retries the batch, failing
	// it only after Retry.Max backoffs. Once the producer is in its fatal
	// state no retry can succeed, so skip the backoff and let the records
	// fail at once with the real cause.
	var self atomic.Pointer[sarama.AsyncProducer]
	backoff := sc.Producer.Retry.BackoffFunc
	sc.Producer.Retry.BackoffFunc = func(retries, maxRetries int) time.Duration {
		if p := self.Load(); p != nil && (*p).TxnStatus()&sarama.ProducerTxnFlagFatalError != 0 {
			return 0
		}
		s.retries.Add(1)
		return backoff(retries, maxRetries)
	}
	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("kafka transactional producer configuration: %w", err)
	}
	client, admin, err := connect(cfg, sc)
	if err != nil {
		return nil, err
	}
	// Creating the producer runs InitProducerID, which fences older
	// producers with this transactional id and aborts their open
	// transaction.
	producer, err := sarama.NewAsyncProducerFromClient(client)
	if err != nil {
		admin.Close()
		return nil, fmt.Errorf("init kafka transactional producer %q: %w (the principal needs Write and Describe on the transactional id, and the brokers transaction support)", tcfg.TransactionalID, err)
	}
	self.Store(&producer)
	s.topics = newTopicResolver(cfg, log, template, client, admin)
	s.admin, s.producer = admin, producer
	go s.run()
	log.Info().Str("transactional_id", tcfg.TransactionalID).Dur("transaction_interval", tcfg.Interval).
		Msg("exactly-once producer initialised; older producers with this transactional id are fenced")
	return s, nil
}

// Build turns an event into a record, rejecting before it joins a
// transaction anything Kafka would refuse: the checks of Publisher.Build,
// and events Kafka already refused inside an earlier transaction. It never
// blocks, and must be called from one goroutine.
func (s *TxnSink) Build(ev *event.Event) (sink.Record, error) {
	if err := s.cfg.Poison.refused(ev.EventID); err != nil {
		return nil, recordError(sink.ClassPermanent, string(ev.EventID), "", -1, err, nil)
	}
	r, err := s.topics.build(ev)
	if err != nil {
		return nil, err // not a nil *Record inside the interface
	}
	r.built = time.Now()
	return r, nil
}

// Input takes the read loop's items, in WAL order.
func (s *TxnSink) Input() chan<- sink.Item { return s.items }

// Outcomes delivers each record's ack, after its Kafka transaction
// committed, or its failure, then the report of that transaction's end. It
// is closed by Close.
func (s *TxnSink) Outcomes() <-chan sink.Outcome { return s.outcomes }

// Retries counts the producer's retries since the sink was made.
func (s *TxnSink) Retries() int64 { return s.retries.Load() }

// Close stops taking items and ends the sink within timeout: a Kafka
// transaction of whole source transactions commits, one ending inside a
// source transaction aborts (its records are reported failed and
// re-streamed later). Outcomes not read by then are dropped. It must not
// be called while a send on Input may still happen.
//
// A commit or abort still unanswered at the timeout is given up on, and
// the producer is closed only once it returned: sarama ends a transaction
// by sending on the producer's input, which a closed producer has closed.
func (s *TxnSink) Close(timeout time.Duration) error {
	var err error
	s.closing.Do(func() {
		s.closeBy = time.Now().Add(timeout)
		close(s.stop)
		close(s.items)
		wait := time.NewTimer(timeout)
		defer wait.Stop()
		select {
		case <-s.done:
		case <-wait.C:
			err = fmt.Errorf("close exactly-once producer: gave up after %s; a commit or abort may still be under way", timeout)
		}
	})
	return err
}

// phase is where the open Kafka transaction stands.
type phase int

const (
	idle       phase = iota // no transaction open
	open                    // taking records
	committing              // CommitTxn under way (the progress record first, if any)
	aborting                // AbortTxn under way
)

// isolation is how far a suspect record, one that may be poison, is: it is
// sent alone, its outcome awaited, so a refusal names it.
type isolation int

const (
	notIsolating isolation = iota
	settleBefore           // the records before it must be answered first
	settleAfter            // sent: its own answer is awaited
)

// txnLoop is the state of the sink's goroutine, which begins, fills and
// commits the Kafka transactions; nothing else touches it.
type txnLoop struct {
	*TxnSink
	successes <-chan *sarama.ProducerMessage
	errs      <-chan *sarama.ProducerError
	timer     *time.Timer
	armed     time.Time // what timer is set for; zero when stopped

	phase    phase
	began    time.Time
	deadline time.Time // when the open transaction is due to commit
	steady   time.Time // when it would be, had it not begun catching up
	// While catching up, the transaction also commits once an interval/2
	// passes with no item taken: the backlog ended, and nothing more will
	// join it soon. Without this the last transaction of a drain waited
	// out the catch-up interval (measured: 1.5 s of a 4.3 s drain).
	idleCheck time.Time
	taken     int // items taken since the last idle check
	// commitCost is how long recent commits took, from the call to the
	// last ack: the steady deadline comes that much earlier, so records
	// become visible an interval after their read, not an interval and a
	// commit.
	commitCost  time.Duration
	commitStart time.Time
	// committedOnce says a transaction of this sink committed. Until one
	// did, the transaction commits at the steady deadline even while
	// catching up: a relay that starts behind (a restart, a failover)
	// otherwise showed read_committed consumers nothing for up to a
	// catch-up interval after its start (measured: the first commit 1.1 to
	// 4.2 s after the start, draining 200,000 single-row transactions).
	committedOnce bool
	// batch holds the transaction's records; one the broker acknowledged
	// is replaced by what acked keeps of it, so a large transaction holds
	// a few dozen bytes per acknowledged record until its commit, not the
	// record (measured: 150 MB peak RSS with whole records kept, draining
	// a backlog in transactions of 8 MiB).
	batch    []*Record
	acked    []ackedRecord // by position; valid where batch is nil
	bytes    int
	complete int             // len(batch) at the last end: records of whole source transactions
	last     *sink.SourceEnd // the last whole source transaction in the batch
	due      bool            // the deadline passed mid source transaction: commit at its end
	split    bool            // the current source transaction was already reported split
	isolate  isolation
	// isolatedAbort says the transaction aborts because the suspect sent
	// alone failed, so a permanent refusal names it.
	isolatedAbort bool

	next     *sarama.ProducerMessage // the message to hand to the producer next
	nextRec  *Record                 // its record; nil for the progress record
	sent     int                     // messages handed to the producer in this transaction
	answered int                     // their acks and errors so far
	failures []failure

	calling  bool       // a CommitTxn or AbortTxn goroutine is running
	result   chan error // its result
	returned bool       // the call under way in this phase returned
	callErr  error
	cause    error     // why the transaction aborts
	endBy    time.Time // when waiting for the end gives up

	broken   error // set once the sink is spent
	stopping bool  // Close was called: give up at closeBy
	closed   bool  // Input was closed and is drained
	pending  []sink.Outcome
}

func (s *TxnSink) run() {
	o := &txnLoop{
		TxnSink: s, successes: s.producer.Successes(), errs: s.producer.Errors(),
		timer: time.NewTimer(time.Hour), result: make(chan error, 1),
	}
	o.timer.Stop()
	o.loop()
	// Outcomes are no longer wanted; what they concern is re-delivered.
	close(s.outcomes)
	if o.calling {
		o.callErr = <-o.result
	}
	s.topics.stop()
	_ = s.producer.Close() // its errors were reported as outcomes already
	s.topics.wait()
	s.topics.spans.abandon()
	s.admin.Close()
	close(s.done)
}

// loop serves until Input is closed and the transaction under way ended, or
// the close deadline passed.
func (o *txnLoop) loop() {
	stop := o.stop
	for {
		if o.closed && o.phase == idle && len(o.pending) == 0 {
			return
		}
		o.arm()
		var items <-chan sink.Item
		if o.canTake() {
			items = o.items
		}
		var in chan<- *sarama.ProducerMessage
		if o.next != nil && o.isolate != settleBefore {
			in = o.producer.Input()
		}
		var out chan<- sink.Outcome
		var first sink.Outcome
		if len(o.pending) > 0 {
			out, first = o.outcomes, o.pending[0]
		}
		select {
		case it, ok := <-items:
			if !ok {
				o.closed = true
				o.finishOnClose()
				continue
			}
			o.take(it)
			o.takeMore()
		case in <- o.next:
			o.handed()
		case msg := <-o.successes:
			o.ack(msg)
			o.takeAcks()
			o.progress()
		case perr := <-o.errs:
			r, _ := perr.Msg.Metadata.(*Record)
			o.failures = append(o.failures, failure{record: r, err: perr.Err})
			o.answered++
			o.progress()
		case err := <-o.result:
			o.calling, o.returned, o.callErr = false, true, err
			o.progress()
		case <-o.timer.C:
			o.armed = time.Time{}
			o.onTimer()
		case out <- first:
			o.pending[0] = sink.Outcome{}
			o.pending = o.pending[1:]
		case <-stop:
			o.stopping, stop = true, nil
		}
		if o.stopping && time.Now().After(o.closeBy) {
			o.giveUp(errors.New("shutting down: the close timeout passed"))
			return
		}
	}
}

// takeMore takes the items already queued on Input, handing each record
// straight to the producer while it has room: one pass of the full select
// per record, and then one per ack, cost a third of the sink's CPU per
// event while catching up.
func (o *txnLoop) takeMore() {
	for {
		if o.next != nil && o.isolate != settleBefore {
			select {
			case o.producer.Input() <- o.next:
				o.handed()
			default:
				return // the producer is full: wait for it in the loop
			}
		}
		if !o.canTake() {
			return
		}
		select {
		case it, ok := <-o.items:
			if !ok {
				o.closed = true
				o.finishOnClose()
				return
			}
			o.take(it)
		default:
			return
		}
	}
}

// ack takes the broker's acknowledgement of one message.
func (o *txnLoop) ack(msg *sarama.ProducerMessage) {
	o.answered++
	r, ok := msg.Metadata.(*Record)
	if !ok || int(r.pos) >= len(o.batch) || o.batch[r.pos] != r {
		return // the progress record, or one of a transaction given up on
	}
	o.acked[r.pos] = ackedRecord{d: delivery(msg), eventID: string(r.rec.EventID)}
	o.batch[r.pos] = nil
}

// ackedRecord is what the sink keeps of a record the broker acknowledged
// until its Kafka transaction ends: enough to report it either way.
type ackedRecord struct {
	d       sink.Delivery
	eventID string
}

// takeAcks takes the acks already waiting.
func (o *txnLoop) takeAcks() {
	for {
		select {
		case msg := <-o.successes:
			o.ack(msg)
		default:
			return
		}
	}
}

// canTake says whether the next item may be taken now: not while a record
// waits for the producer, a suspect's neighbours are answered, or the
// transaction ends; a spent sink takes every item, to report it failed.
func (o *txnLoop) canTake() bool {
	if o.closed {
		return false
	}
	if o.broken != nil {
		return o.phase == idle
	}
	return o.phase <= open && o.next == nil && o.isolate == notIsolating && len(o.failures) == 0
}

func (o *txnLoop) take(it sink.Item) {
	o.taken++
	switch {
	case it.Record != nil:
		o.record(it.Record.(*Record))
	case it.End != nil:
		o.end(it.End)
	case it.Flush:
		if o.phase == open {
			o.commit()
		}
	}
}

func (o *txnLoop) record(r *Record) {
	if o.broken != nil {
		o.failOne(r, o.broken)
		return
	}
	if o.phase == idle {
		if err := o.producer.BeginTxn(); err != nil {
			o.spend(fmt.Errorf("begin kafka transaction: %w", err))
			o.failOne(r, o.broken)
			return
		}
		o.phase, o.began = open, time.Now()
		o.deadline = commitDeadline(r.built, r.commitTime, o.began, o.cfg.Interval, o.commitCost)
		o.steady = steadyDeadline(r.built, o.began, o.cfg.Interval, o.commitCost)
		if !o.committedOnce {
			o.deadline = o.steady
		}
		if o.deadline.After(o.steady) {
			o.idleCheck, o.taken = o.steady, 0
		}
	}
	r.pos = int32(len(o.batch))
	o.batch = append(o.batch, r)
	o.acked = append(o.acked, ackedRecord{})
	o.bytes += r.Size()
	o.next, o.nextRec = &r.msg, r
	if o.cfg.Poison.suspect(r.rec.EventID) {
		o.isolate = settleBefore
		o.progress()
	}
}

// handed follows a message into the producer.
func (o *txnLoop) handed() {
	o.next, o.nextRec, o.sent = nil, nil, o.sent+1
	switch {
	case o.phase == committing:
		o.call(o.producer.CommitTxn) // the progress record is in
	case o.isolate == settleAfter:
		o.progress()
	case len(o.batch) >= o.cfg.MaxEvents || o.bytes >= o.cfg.MaxBytes || time.Since(o.began) >= o.cfg.MaxAge:
		o.commit()
	}
}

func (o *txnLoop) end(e *sink.SourceEnd) {
	if o.broken != nil || o.phase != open {
		return // no records, or spent: nothing to commit
	}
	o.complete, o.split = len(o.batch), false
	o.last = e
	now := time.Now()
	if o.steady.Before(o.deadline) && caughtUp(e.CommitTime, now, o.cfg.Interval) {
		o.deadline, o.idleCheck = o.steady, time.Time{}
	}
	if o.due || len(o.batch) >= o.cfg.BatchEvents || o.bytes >= o.cfg.BatchBytes || !now.Before(o.deadline) {
		o.commit()
	}
}

func (o *txnLoop) onTimer() {
	switch o.phase {
	case open:
		if now := time.Now(); !o.idleCheck.IsZero() && now.Before(o.deadline) {
			// Idle only if the loop sent nothing: not while the sink
			// itself waited on the producer with items queued.
			if o.taken > 0 || len(o.items) > 0 || o.next != nil || o.complete < len(o.batch) {
				o.idleCheck, o.taken = now.Add(o.cfg.Interval/2), 0
				return
			}
		}
		if o.complete == len(o.batch) {
			o.commit()
		} else {
			o.due = true
		}
	case committing, aborting:
		if time.Now().After(o.endBy) {
			o.giveUp(fmt.Errorf("no answer from Kafka within the transaction timeout (%s); check the brokers, above all the one coordinating transactional id %q", o.cfg.Timeout, o.cfg.TransactionalID))
		}
	}
}

// arm sets the timer for the open transaction's deadline, or for giving up
// on its end.
func (o *txnLoop) arm() {
	var at time.Time
	switch o.phase {
	case open:
		if !o.due {
			at = o.deadline
			if !o.idleCheck.IsZero() && o.idleCheck.Before(at) {
				at = o.idleCheck
			}
		}
	case committing, aborting:
		at = o.endBy
	}
	if o.stopping && (at.IsZero() || o.closeBy.Before(at)) {
		at = o.closeBy
	}
	if at.Equal(o.armed) {
		return
	}
	o.armed = at
	if at.IsZero() {
		o.timer.Stop()
		return
	}
	o.timer.Reset(time.Until(at))
}

// commit ends the open transaction with its progress record: the record
// is handed to the producer, then CommitTxn runs. A transaction that holds
// a failure aborts instead.
func (o *txnLoop) commit() {
	if o.phase != open {
		return
	}
	if len(o.failures) > 0 {
		o.abort(nil)
		return
	}
	if o.complete < len(o.batch) && !o.split {
		o.split = true
		o.report(sink.Outcome{KafkaTxn: &sink.TxnReport{Split: true}})
		o.log.Warn().Int("records", len(o.batch)-o.complete).
			Msg("a source transaction is larger than one Kafka transaction may hold: committing it in parts; read_committed consumers see its first part before the rest, and a crash before its last part re-delivers the committed parts")
	}
	o.phase, o.returned, o.endBy, o.commitStart = committing, false, o.endDeadline(), time.Now()
	if o.last != nil && o.last.Progress != nil {
		p := o.last.Progress
		value := p.Value
		if p.Encode != nil {
			value = p.Encode(o.last.End, o.last.CommitTime)
		}
		o.next = &sarama.ProducerMessage{Topic: p.Topic, Key: sarama.ByteEncoder(p.Key), Value: sarama.ByteEncoder(value)}
		return // CommitTxn once the producer took it; see handed
	}
	o.call(o.producer.CommitTxn)
}

// abort aborts the open transaction; cause is what failed, when not a
// record.
func (o *txnLoop) abort(cause error) {
	o.phase, o.returned, o.cause, o.endBy = aborting, false, cause, o.endDeadline()
	o.next, o.nextRec = nil, nil
	o.call(o.producer.AbortTxn)
}

// endDeadline bounds the wait for a commit or an abort to be answered, its
// records' acks included, by the transaction timeout. sarama retries an
// unanswered EndTxn up to Producer.Transaction.Retry.Max times, each after
// a full Net.ReadTimeout: a coordinator that takes requests but never
// answers would hold the stream for many minutes with nothing logged. Past
// the timeout the coordinator has aborted the transaction, unless the
// commit already reached it, and then only the progress record, committed
// with it, tells; so the sink gives up and the caller re-streams from that
// record either way.
func (o *txnLoop) endDeadline() time.Time {
	by := time.Now().Add(o.cfg.Timeout)
	if o.stopping && o.closeBy.Before(by) {
		return o.closeBy
	}
	return by
}

// call runs a blocking producer call on a goroutine of its own; its
// result comes back on o.result.
func (o *txnLoop) call(fn func() error) {
	o.calling = true
	go func() { o.result <- fn() }()
}

// progress moves the transaction on after an answer from the producer or
// the end of a call.
func (o *txnLoop) progress() {
	settled := o.answered >= o.sent
	switch o.phase {
	case open:
		if !settled {
			return
		}
		switch {
		case o.isolate == settleBefore && len(o.failures) > 0:
			o.abort(nil)
		case o.isolate == settleBefore:
			o.isolate = settleAfter
		case o.isolate == settleAfter:
			o.isolate = notIsolating
			if len(o.failures) > 0 {
				o.isolatedAbort = true
				o.abort(nil)
			}
		case len(o.failures) > 0:
			o.abort(nil)
		}
	case committing:
		if !o.returned || !settled {
			return
		}
		switch {
		case o.callErr != nil:
			o.abort(fmt.Errorf("commit kafka transaction: %w", o.callErr))
		case len(o.failures) > 0:
			// sarama refuses to commit after a failed record, so this is
			// a broken invariant of the library: the transaction is
			// committed without the failed record. Re-stream; the rest is
			// duplicated.
			f := o.failures[0]
			o.log.Error().Err(f.err).Msg("kafka transaction committed although one of its records failed; re-streaming, which duplicates the transaction's other records")
			o.spend(fmt.Errorf("%w: kafka transaction committed without a failed record: %w", ErrTxnAborted, f.err))
			o.failAll(sink.ClassRetriable)
		default:
			o.committed()
		}
	case aborting:
		if o.returned && settled {
			o.aborted(false)
		}
	}
}

func (o *txnLoop) committed() {
	now := time.Now()
	o.commitCost = (3*o.commitCost + now.Sub(o.commitStart)) / 4
	o.committedOnce = true
	for i, r := range o.batch {
		d := o.acked[i].d
		if r != nil { // acknowledged without passing through ack: not expected
			d = delivery(&r.msg)
		}
		d.At = now // the ack that counts is the commit
		o.report(sink.Outcome{Delivery: d})
	}
	o.cfg.Poison.committed(o.eventIDs)
	rep := &sink.TxnReport{Committed: true}
	if o.last != nil {
		rep.End, rep.CommitTime = o.last.End, o.last.CommitTime
	}
	o.report(sink.Outcome{KafkaTxn: rep})
	o.reset()
}

// aborted reports every record of the aborted transaction failed and
// leaves the sink spent.
func (o *txnLoop) aborted(gaveUp bool) {
	cause := o.cause
	if cause == nil && len(o.failures) > 0 {
		cause = o.failures[0].err
		if o.failures[0].record == nil {
			cause = fmt.Errorf("progress record: %w (check --progress-topic and the relay's Write on it)", cause)
		}
	}
	abortErr := o.callErr
	if cause == nil {
		cause = abortErr
	} else if abortErr != nil && !gaveUp {
		cause = fmt.Errorf("%w; abort kafka transaction: %w", cause, abortErr)
	}
	if abortErr != nil && !gaveUp {
		// An abort that did not go through leaves the producer unusable.
		o.log.Error().Err(abortErr).Msg("could not abort the kafka transaction; the broker aborts it at its timeout")
	}
	class := sink.ClassRetriable
	if fenced(cause) {
		class = sink.ClassFenced
	} else {
		o.cfg.Poison.learn(o.failures, o.isolatedAbort)
	}
	o.spend(cause)
	o.failAll(class)
	o.report(sink.Outcome{KafkaTxn: &sink.TxnReport{}})
}

// giveUp ends waiting for a commit or an abort that Kafka does not answer:
// every record of the transaction is reported failed, the sink is spent,
// and the call keeps running until the producer closes.
func (o *txnLoop) giveUp(why error) {
	if o.phase == idle {
		return
	}
	o.cause = errors.Join(why, o.cause)
	o.callErr = nil
	if o.phase == open {
		o.cause = fmt.Errorf("%w: shutting down in the middle of a source transaction", ErrTxnAborted)
	}
	o.aborted(true)
}

// finishOnClose ends the transaction open when Input closes: one of whole
// source transactions commits, one holding part of a source transaction
// aborts.
func (o *txnLoop) finishOnClose() {
	if o.phase != open || o.broken != nil {
		return
	}
	if o.complete == len(o.batch) && o.isolate == notIsolating {
		o.commit()
		return
	}
	o.abort(fmt.Errorf("%w: shutting down in the middle of a source transaction", ErrTxnAborted))
}

// spend marks the sink unusable with err, in the form every later record
// is failed with.
func (o *txnLoop) spend(err error) {
	if o.broken != nil {
		return
	}
	if fenced(err) {
		err = fmt.Errorf("%w: %w; stop this instance or let it wait as a standby: another relay with transactional id %q owns the stream", sink.ErrFenced, err, o.cfg.TransactionalID)
	} else if !errors.Is(err, ErrTxnAborted) {
		err = fmt.Errorf("%w: %w", ErrTxnAborted, err)
	}
	o.broken = err
}

// failAll reports every record of the transaction failed.
func (o *txnLoop) failAll(class sink.Class) {
	for i, r := range o.batch {
		if r != nil {
			o.failOneAs(r, o.broken, class)
			continue
		}
		a := o.acked[i]
		d := a.d
		d.Partition, d.Offset, d.At = -1, -1, time.Now()
		o.report(sink.Outcome{Delivery: d, Err: recordError(class, a.eventID, d.Topic, -1, o.broken, nil)})
	}
	o.reset()
}

// eventIDs yields the event ids of the transaction's records.
func (o *txnLoop) eventIDs(yield func(string) bool) {
	for i, r := range o.batch {
		id := o.acked[i].eventID
		if r != nil {
			id = r.EventID()
		}
		if !yield(id) {
			return
		}
	}
}

func (o *txnLoop) failOne(r *Record, err error) {
	class := sink.ClassRetriable
	if errors.Is(err, sink.ErrFenced) {
		class = sink.ClassFenced
	}
	o.failOneAs(r, err, class)
}

func (o *txnLoop) failOneAs(r *Record, err error, class sink.Class) {
	d := failedDelivery(r)
	// No partition: read_committed readers never see an aborted record,
	// so its re-delivery cannot land out of order.
	o.report(sink.Outcome{Delivery: d, Err: recordError(class, r.EventID(), d.Topic, -1, err, nil)})
}

func (o *txnLoop) report(out sink.Outcome) {
	o.topics.spans.end(&out)
	o.pending = append(o.pending, out)
}

func (o *txnLoop) reset() {
	if o.broken != nil || o.complete == len(o.batch) {
		o.split = false
	}
	o.phase, o.due, o.last, o.isolate, o.isolatedAbort = idle, false, nil, notIsolating, false
	o.idleCheck, o.taken = time.Time{}, 0
	clear(o.batch)
	clear(o.acked)
	o.batch, o.acked, o.bytes, o.complete = o.batch[:0], o.acked[:0], 0, 0
	o.next, o.nextRec, o.sent, o.answered, o.failures = nil, nil, 0, 0, o.failures[:0]
	o.returned, o.callErr, o.cause = false, nil, nil
}
