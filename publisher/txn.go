package publisher

// The exactly-once sink: records go into Kafka transactions that each hold
// one or more whole source (PostgreSQL) transactions plus the progress
// record of the last of them, so what Kafka committed and where the relay
// resumes can never disagree. Acks are reported only once the Kafka
// transaction committed; a record that fails aborts the transaction and every
// record of it is reported failed, so the caller re-streams from the last
// committed progress.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// ErrFenced means another producer with the same transactional id started:
// this one must never commit again. The relay stops, or goes back to
// waiting as a standby; it must not retry with the same producer.
var ErrFenced = errors.New("kafka producer fenced by a newer producer with the same transactional id")

// ErrTxnAborted marks the records of an aborted Kafka transaction. None of
// them is visible to read_committed consumers; the caller re-streams them
// from the last committed progress.
var ErrTxnAborted = errors.New("kafka transaction aborted")

// ClassFenced is the class of the failures reported after the producer was
// fenced. Unlike the other classes it is fatal to the producer's session and
// to the instance: another instance now owns the transactional id.
const ClassFenced Class = "fenced"

// TransactionalID is the default transactional.id of a relay: the
// replication slot and the database's system identifier, the same pair that
// keys the progress record. Two relays on one slot of one cluster share it,
// so the newer fences the older; relays of different slots or clusters never
// fence each other.
func TransactionalID(slot, systemID string) string {
	return "outbox-relay:" + slot + "@" + systemID
}

// ProgressRecord is the record that says how far Kafka holds the stream. It
// is written into every Kafka transaction, for the last whole source
// transaction in it.
type ProgressRecord struct {
	Topic      string
	Key, Value []byte
}

// TxnConfig shapes the exactly-once sink. The zero value of every field but
// TransactionalID means its default.
type TxnConfig struct {
	// TransactionalID identifies the producer across restarts; see
	// TransactionalID.
	TransactionalID string

	// Interval is how long a Kafka transaction stays open, from its first
	// record's build (see commitDeadline), before it commits at the next
	// source-transaction boundary
	// (--transaction-interval). read_committed consumers see nothing of a
	// transaction before it commits, so it adds to their latency; each
	// commit costs a constant (AddPartitionsToTxn, EndTxn, one marker per
	// partition), so it must not be too short either.
	Interval time.Duration

	// BatchEvents and BatchBytes end a Kafka transaction at the next
	// source-transaction boundary once it holds that much. Keep them below
	// the caller's in-flight limits, since acks are held until the commit.
	BatchEvents int
	BatchBytes  int

	// MaxEvents, MaxBytes and MaxAge bound one Kafka transaction. A single
	// source transaction that outgrows them is split, committed in parts:
	// the one exception to whole source transactions. MaxAge must stay well
	// below Timeout, which the broker caps with transaction.max.timeout.ms.
	MaxEvents int
	MaxBytes  int
	MaxAge    time.Duration

	// Timeout is the transaction timeout sent to the coordinator: a
	// transaction open longer is aborted by the broker. It also bounds
	// the wait for a commit or an abort to be answered (see endWait).
	Timeout time.Duration

	// Progress returns the progress record for the last whole source
	// transaction of a Kafka transaction. Nil writes none.
	Progress func(txn lsn.TxnID, end lsn.LSN, commitTime time.Time) (ProgressRecord, error)

	// Observer, when set, is told of each Kafka transaction's end, for
	// the caller's metrics and status. Its calls must not block.
	Observer TxnObserver

	// Poison remembers events Kafka refused across sessions. The caller
	// keeps one for the life of the process and passes it to every sink it
	// makes; nil gives this sink a memory of its own.
	Poison *PoisonMemory
}

// DefaultTxnConfig returns the defaults; the caller sets the
// transactional id and the progress record.
func DefaultTxnConfig() TxnConfig {
	return TxnConfig{
		Interval:    100 * time.Millisecond,
		BatchEvents: 5000,
		BatchBytes:  8 << 20,
		MaxEvents:   100000,
		MaxBytes:    64 << 20,
		MaxAge:      20 * time.Second,
		Timeout:     60 * time.Second,
	}
}

func (c TxnConfig) withDefaults() TxnConfig {
	d := DefaultTxnConfig()
	orDefault(&c.Interval, d.Interval)
	orDefault(&c.BatchEvents, d.BatchEvents)
	orDefault(&c.BatchBytes, d.BatchBytes)
	orDefault(&c.MaxEvents, d.MaxEvents)
	orDefault(&c.MaxBytes, d.MaxBytes)
	orDefault(&c.Timeout, d.Timeout)
	if c.MaxAge <= 0 {
		c.MaxAge = min(d.MaxAge, c.Timeout/3)
	}
	if c.Poison == nil {
		c.Poison = NewPoisonMemory(0)
	}
	return c
}

// orDefault sets a zero or negative setting to its default.
func orDefault[T int | time.Duration](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}

// TxnObserver is told what the exactly-once sink did; the counts of all
// the sinks a process makes add up, which TxnStats of one sink cannot.
type TxnObserver interface {
	// Committed is called after a Kafka transaction committed; end and
	// commitTime are those of its last whole source transaction, zero
	// when it held none (only part of a split one).
	Committed(end lsn.LSN, commitTime time.Time)
	Aborted()
	// Split is called once for each source transaction committed in parts.
	Split()
}

// Retries is how many times the producer has backed off to retry a record
// since it was made.
func (t *TxnPublisher) Retries() int64 { return t.pub.retries.Load() }

// TxnStats are the sink's counters, for metrics and the admin endpoint.
type TxnStats struct {
	TransactionalID string
	Committed       uint64 // Kafka transactions committed
	Aborted         uint64 // Kafka transactions aborted
	// SplitSourceTxns counts source transactions too large for one Kafka
	// transaction, which were committed in parts.
	SplitSourceTxns uint64
	// Poisoned counts events Kafka refused inside a transaction; each is
	// rejected by Build when it comes again.
	Poisoned uint64
	// LastCommitted is the end of the last source transaction whose
	// progress record committed; zero before the first commit.
	LastCommitted     lsn.LSN
	LastCommittedTime time.Time // its source commit time
	LastCommitAt      time.Time // when that Kafka transaction committed
}

// sourceEnd is the last whole source transaction in a Kafka transaction.
type sourceEnd struct {
	txn        lsn.TxnID
	end        lsn.LSN
	commitTime time.Time
}

// failure is a record the producer reported failed.
type failure struct {
	record *Record // nil for the progress record
	err    error
}

// TxnPublisher is the exactly-once engine, for callers that drive it
// themselves: Build, Send, EndTxn, Commit and Close block until Kafka
// answered; a timer goroutine commits batches that reach Interval while the
// caller is idle, and a drain goroutine collects the producer's outcomes.
// Handler calls are serialised but may come from either the caller's
// goroutine or the timer goroutine. TxnSink puts it behind channels for a
// read loop that must never block on Kafka.
//
// After any failure the sink is spent: every later call returns the error,
// and the caller closes it and re-streams with a new one. It must re-stream
// from the progress record read back from Kafka with read_committed, not
// from what this sink reported: when a commit's answer is lost, the
// transaction may have committed although the sink reports its records
// failed, and only the progress record, committed with them, tells.
type TxnPublisher struct {
	pub     *Publisher
	cfg     TxnConfig
	handler Handler
	log     zerolog.Logger

	// turn is held by whoever drives the Kafka transaction (the caller
	// in Send or EndTxn, or the timer goroutine committing); it is a
	// channel rather than a mutex so waiting for it can end with ctx.
	turn chan struct{}

	// Guarded by turn.
	open     bool
	began    time.Time
	deadline time.Time // when the open transaction is due to commit
	batch    []*Record
	bytes    int
	complete int        // len(batch) at the last EndTxn: records of whole source txns
	last     *sourceEnd // the last whole source transaction in the batch
	due      bool       // Interval passed mid source transaction: commit at its end
	splitOne bool       // the current source transaction was already counted as split
	broken   error
	progress bool // the progress record was sent in the open transaction

	// Outcomes of the open transaction, from the drain goroutine.
	mu       sync.Mutex
	outcomes int
	failures []failure
	changed  chan struct{} // signalled after each outcome

	armed     chan time.Time // deadline of a newly begun transaction, for the timer goroutine
	stop      chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
	calls     sync.WaitGroup // producer calls whileWaiting started

	committed, aborted, split, poisoned atomic.Uint64
	statsMu                             sync.Mutex
	lastCommitted                       sourceEnd
	lastCommitAt                        time.Time
}

// NewTxn connects to Kafka, initialises the transactional producer (which
// fences any older producer with the same transactional id) and starts the
// sink's goroutines.
func NewTxn(cfg Config, tcfg TxnConfig, handler Handler, log zerolog.Logger) (*TxnPublisher, error) {
	if tcfg.TransactionalID == "" {
		return nil, errors.New("exactly-once delivery needs a transactional id: set --transactional-id or let the relay derive it from the slot")
	}
	tcfg = tcfg.withDefaults()
	topics, err := parseTopicTemplate(cfg.TopicTemplate)
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
	// sarama treats a fatal AddPartitionsToTxn answer (PRODUCER_FENCED
	// among them) like a broken connection and retries the batch, failing
	// it only after Retry.Max backoffs. Once the producer is in its fatal
	// state no retry can succeed, so skip the backoff and let the records
	// fail at once with the real cause.
	pub := newPublisher(cfg, log, topics)
	var self atomic.Pointer[sarama.AsyncProducer]
	backoff := sc.Producer.Retry.BackoffFunc
	sc.Producer.Retry.BackoffFunc = func(retries, maxRetries int) time.Duration {
		if p := self.Load(); p != nil && (*p).TxnStatus()&sarama.ProducerTxnFlagFatalError != 0 {
			return 0
		}
		pub.retries.Add(1)
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
	pub.client, pub.admin, pub.producer = client, admin, producer
	t := &TxnPublisher{
		pub: pub, cfg: tcfg, handler: handler, log: log,
		turn:    make(chan struct{}, 1),
		changed: make(chan struct{}, 1),
		armed:   make(chan time.Time, 1),
		stop:    make(chan struct{}),
	}
	t.wg.Add(2)
	go t.drain()
	go t.commitOnTime()
	log.Info().Str("transactional_id", tcfg.TransactionalID).Dur("transaction_interval", tcfg.Interval).
		Msg("exactly-once producer initialised; older producers with this transactional id are fenced")
	return t, nil
}

// connect opens the client and admin client a producer shares.
func connect(cfg Config, sc *sarama.Config) (sarama.Client, sarama.ClusterAdmin, error) {
	client, err := sarama.NewClient(cfg.Brokers, sc)
	if err != nil {
		return nil, nil, ConnectError(cfg, err)
	}
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		client.Close()
		return nil, nil, fmt.Errorf("create kafka admin client: %w", err)
	}
	return client, admin, nil
}

// retriesWithin is how many retries the producer's backoff (doubling from
// 100ms up to backoffMax, jittered down to half) fits into budget.
func retriesWithin(backoffMax, budget time.Duration) int {
	n := 0
	for total, d := time.Duration(0), 100*time.Millisecond; total < budget; n++ {
		total += min(d, backoffMax) * 3 / 4
		d *= 2
	}
	return max(n, 1)
}

// Build turns an event into a record, rejecting before it joins a
// transaction anything Kafka would refuse: the checks of Publisher.Build,
// and events Kafka already refused inside an earlier transaction.
func (t *TxnPublisher) Build(ev *Event) (*Record, error) {
	if err := t.cfg.Poison.refused(ev.EventID); err != nil {
		return nil, &Error{Class: ClassPermanent, EventID: string(ev.EventID), Partition: -1, Err: err}
	}
	r, err := t.pub.Build(ev)
	if err == nil {
		r.built = time.Now()
	}
	return r, err
}

// BuildWait is Build for callers without a loop of their own: it waits,
// until ctx ends, for the event's topic to be looked up.
func (t *TxnPublisher) BuildWait(ctx context.Context, ev *Event) (*Record, error) {
	return buildWait(ctx, t.Build, ev)
}

// Send adds a built record to the open Kafka transaction, beginning one if
// none is open. It blocks while the producer is full or a commit is under
// way.
func (t *TxnPublisher) Send(ctx context.Context, r *Record) error {
	_, err := t.send(ctx, r)
	return err
}

// send is Send that also says whether r joined the transaction: a record
// that did is reported through the handler, one that did not is not.
func (t *TxnPublisher) send(ctx context.Context, r *Record) (joined bool, err error) {
	if err := t.enter(ctx); err != nil {
		return false, err
	}
	defer t.release()
	if !t.open {
		if err := t.begin(r.built); err != nil {
			return false, err
		}
	}
	if t.firstFailure() != nil {
		// Everything sent from now on would be refused anyway.
		return false, t.abort(ctx, nil, false)
	}
	// A suspect is sent alone, its outcome awaited, so a refusal names it:
	// the broker fails whole batches, and a failed transaction fails
	// every record after the first failure with that same error.
	suspect := t.cfg.Poison.suspect(r.eventID)
	if suspect {
		if err := t.awaitOutcomes(ctx, len(t.batch)); err != nil {
			return false, t.fail(ctx, err)
		}
		if t.firstFailure() != nil {
			return false, t.abort(ctx, nil, false)
		}
	}
	t.batch = append(t.batch, r)
	t.bytes += r.size
	if err := t.sendWaiting(ctx, &r.msg); err != nil {
		// The record may or may not be in the producer now; the
		// transaction cannot be trusted either way.
		return true, t.fail(ctx, fmt.Errorf("send record: %w", err))
	}
	if suspect {
		if err := t.awaitOutcomes(ctx, len(t.batch)); err != nil {
			return true, t.fail(ctx, err)
		}
		if t.firstFailure() != nil {
			return true, t.abort(ctx, nil, true)
		}
	}
	if len(t.batch) >= t.cfg.MaxEvents || t.bytes >= t.cfg.MaxBytes || time.Since(t.began) >= t.cfg.MaxAge {
		return true, t.commit(ctx)
	}
	return true, nil
}

// EndTxn tells the sink that the source transaction whose records were just
// sent has ended. The Kafka transaction may commit here, and only at such a
// boundary (save for a split oversize source transaction).
func (t *TxnPublisher) EndTxn(ctx context.Context, txn lsn.TxnID, end lsn.LSN, commitTime time.Time) error {
	if err := t.enter(ctx); err != nil {
		return err
	}
	defer t.release()
	if !t.open {
		return nil // the source transaction had no records: nothing to commit
	}
	t.complete, t.splitOne = len(t.batch), false
	t.last = &sourceEnd{txn: txn, end: end, commitTime: commitTime}
	if t.due || len(t.batch) >= t.cfg.BatchEvents || t.bytes >= t.cfg.BatchBytes || !time.Now().Before(t.deadline) {
		return t.commit(ctx)
	}
	return nil
}

// Commit commits the open Kafka transaction now. The caller calls it when
// its in-flight limits are full, since acks wait for the commit; in the
// middle of a source transaction that splits it, which is counted.
func (t *TxnPublisher) Commit(ctx context.Context) error {
	if err := t.enter(ctx); err != nil {
		return err
	}
	defer t.release()
	return t.commit(ctx)
}

// enter takes the turn for one of the caller's calls, unless the sink is
// spent; the caller releases it.
func (t *TxnPublisher) enter(ctx context.Context) error {
	if err := t.acquire(ctx); err != nil {
		return err
	}
	if t.broken != nil {
		t.release()
		return t.broken
	}
	return nil
}

// Stats returns the sink's counters.
func (t *TxnPublisher) Stats() TxnStats {
	t.statsMu.Lock()
	defer t.statsMu.Unlock()
	return TxnStats{
		TransactionalID: t.cfg.TransactionalID,
		Committed:       t.committed.Load(), Aborted: t.aborted.Load(),
		SplitSourceTxns: t.split.Load(), Poisoned: t.poisoned.Load(),
		LastCommitted: t.lastCommitted.end, LastCommittedTime: t.lastCommitted.commitTime,
		LastCommitAt: t.lastCommitAt,
	}
}

// Close ends the sink within timeout: a Kafka transaction holding only
// whole source transactions commits, one holding part of a source
// transaction aborts (its records are reported failed and re-streamed
// later), then the producer closes.
func (t *TxnPublisher) Close(timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	alreadyClosed := true
	t.closeOnce.Do(func() { alreadyClosed = false })
	if alreadyClosed {
		return nil
	}
	close(t.stop)
	close(t.pub.quit)
	var first error
	held := t.acquire(ctx) == nil
	if !held {
		first = fmt.Errorf("close exactly-once producer: a commit or abort still running after %s: %w", timeout, ctx.Err())
	} else {
		if t.open && t.broken == nil {
			var err error
			if t.complete == len(t.batch) {
				err = t.commit(ctx)
			} else {
				err = t.abort(ctx, fmt.Errorf("%w: shutting down in the middle of a source transaction", ErrTxnAborted), false)
			}
			if err != nil && !errors.Is(err, ErrTxnAborted) {
				first = err
			}
		}
		t.broken = errors.New("exactly-once producer closed")
		t.release()
	}
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		if !held {
			// Whoever holds the turn gives up at its own deadline; after
			// that nothing may begin a producer call.
			t.turn <- struct{}{}
			t.broken = errors.New("exactly-once producer closed")
			t.release()
		}
		// A commit or abort given up on still runs, and sarama sends the
		// end of a transaction on the producer's input: closing the
		// producer under it would panic on the closed input.
		t.calls.Wait()
		_ = t.pub.producer.Close() // its errors were reported through the handler
		t.wg.Wait()
		t.pub.admin.Close()
	}()
	select {
	case <-closed:
	case <-ctx.Done():
		// A broker that never answers must not hang shutdown; the
		// producer closes, and our goroutines end, once the call under
		// way returns.
		if first == nil {
			first = fmt.Errorf("close exactly-once producer: gave up after %s", timeout)
		}
	}
	return first
}

// begin opens a Kafka transaction for a first record built at firstBuilt.
func (t *TxnPublisher) begin(firstBuilt time.Time) error {
	if err := t.pub.producer.BeginTxn(); err != nil {
		return t.spent(t.classify(fmt.Errorf("begin kafka transaction: %w", err)))
	}
	t.open = true
	t.began = time.Now()
	t.deadline = commitDeadline(firstBuilt, t.began, t.cfg.Interval)
	t.mu.Lock()
	t.outcomes, t.failures = 0, t.failures[:0]
	t.mu.Unlock()
	select {
	case <-t.armed: // a deadline the timer goroutine never took is stale
	default:
	}
	t.armed <- t.deadline
	return nil
}

// commitDeadline is when a Kafka transaction begun at began, whose first
// record was built at firstBuilt, is due to commit. The interval runs from
// the record's build, not the begin: a record that waited out the previous
// commit would otherwise wait that commit, a whole interval and its own
// commit before read_committed consumers see it. The transaction still
// stays open at least half an interval, so records that queued behind a
// slow commit while catching up do not make each transaction tiny.
func commitDeadline(firstBuilt, began time.Time, interval time.Duration) time.Time {
	if firstBuilt.IsZero() || firstBuilt.After(began) {
		firstBuilt = began
	}
	return maxTime(firstBuilt.Add(interval), began.Add(interval/2))
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// commit ends the open Kafka transaction with its progress record and
// reports the acks; any failure aborts it instead. Called holding turn.
func (t *TxnPublisher) commit(ctx context.Context) error {
	if !t.open {
		return nil
	}
	if t.complete < len(t.batch) && !t.splitOne {
		t.split.Add(1)
		t.splitOne = true
		if t.cfg.Observer != nil {
			t.cfg.Observer.Split()
		}
		t.log.Warn().Int("records", len(t.batch)-t.complete).
			Msg("a source transaction is larger than one Kafka transaction may hold: committing it in parts; read_committed consumers see its first part before the rest, and a crash before its last part re-delivers the committed parts")
	}
	sent := len(t.batch)
	if t.last != nil && t.cfg.Progress != nil {
		rec, err := t.cfg.Progress(t.last.txn, t.last.end, t.last.commitTime)
		if err != nil {
			return t.abort(ctx, fmt.Errorf("build progress record: %w", err), false)
		}
		msg := &sarama.ProducerMessage{Topic: rec.Topic, Key: sarama.ByteEncoder(rec.Key), Value: sarama.ByteEncoder(rec.Value)}
		if err := t.sendWaiting(ctx, msg); err != nil {
			return t.fail(ctx, fmt.Errorf("send progress record: %w", err))
		}
		t.progress = true
		sent++
	}
	if t.firstFailure() != nil {
		return t.abort(ctx, nil, false)
	}
	wait, cancel := t.endWait(ctx)
	defer cancel()
	err := t.whileWaiting(wait, t.pub.producer.CommitTxn)
	if wait.Err() != nil {
		return t.fail(wait, fmt.Errorf("commit kafka transaction: %w", t.unanswered(ctx, wait)))
	}
	if werr := t.awaitOutcomes(wait, sent); werr != nil {
		return t.fail(wait, fmt.Errorf("commit kafka transaction: records not acknowledged: %w", t.unanswered(ctx, wait)))
	}
	if err != nil {
		return t.abort(ctx, fmt.Errorf("commit kafka transaction: %w", err), false)
	}
	if f := t.firstFailure(); f != nil {
		// sarama refuses to commit after a failed record, so this is a
		// broken invariant of the library: the transaction is committed
		// without the failed record. Re-stream; the rest is duplicated.
		t.log.Error().Err(f.err).Msg("kafka transaction committed although one of its records failed; re-streaming, which duplicates the transaction's other records")
		return t.spent(t.report(fmt.Errorf("kafka transaction committed without a failed record: %w", f.err), ClassRetriable))
	}

	// Stats first, so whoever reads an ack also reads the commit in them.
	t.committed.Add(1)
	var last sourceEnd
	if t.last != nil {
		last = *t.last
		t.statsMu.Lock()
		t.lastCommitted, t.lastCommitAt = last, time.Now()
		t.statsMu.Unlock()
	}
	for _, r := range t.batch {
		t.handler.Acked(delivery(&r.msg))
	}
	t.cfg.Poison.committed(t.batch)
	if t.cfg.Observer != nil {
		t.cfg.Observer.Committed(last.end, last.commitTime)
	}
	t.reset()
	return nil
}

// abort aborts the open Kafka transaction and reports every record of it
// failed. cause is what failed, when not a record; isolated says the last
// record was sent alone, so a permanent refusal of it names the poison.
func (t *TxnPublisher) abort(ctx context.Context, cause error, isolated bool) error {
	wait, cancel := t.endWait(ctx)
	defer cancel()
	abortErr := t.whileWaiting(wait, t.pub.producer.AbortTxn)
	if wait.Err() != nil {
		abortErr = t.unanswered(ctx, wait)
	}
	sent := len(t.batch)
	if t.progress {
		sent++
	}
	if err := t.awaitOutcomes(wait, sent); err != nil {
		return t.spent(t.report(fmt.Errorf("abort kafka transaction: records not acknowledged: %w", t.unanswered(ctx, wait)), ClassRetriable))
	}
	t.mu.Lock()
	failures := append([]failure(nil), t.failures...)
	t.mu.Unlock()
	if cause == nil && len(failures) > 0 {
		cause = failures[0].err
		if failures[0].record == nil {
			cause = fmt.Errorf("progress record: %w (check --progress-topic and the relay's Write on it)", cause)
		}
	}
	if cause == nil {
		cause = abortErr
	}
	if abortErr != nil {
		cause = fmt.Errorf("%w; abort kafka transaction: %w", cause, abortErr)
	}
	t.aborted.Add(1)
	if t.cfg.Observer != nil {
		t.cfg.Observer.Aborted()
	}
	if fenced(cause) {
		return t.spent(t.report(cause, ClassFenced))
	}
	if n := t.cfg.Poison.learn(failures, isolated); n > 0 {
		t.poisoned.Add(uint64(n))
	}
	err := t.report(cause, ClassRetriable)
	if abortErr != nil {
		// An abort that did not go through leaves the producer unusable.
		t.log.Error().Err(abortErr).Msg("could not abort the kafka transaction; the broker aborts it at its timeout")
	}
	return t.spent(err)
}

// endWait bounds the wait for a commit or an abort to be answered, its
// records' acks included, by the transaction timeout. sarama retries an
// unanswered EndTxn up to Producer.Transaction.Retry.Max times, each after
// a full Net.ReadTimeout: a coordinator that takes requests but never
// answers would hold the stream for many minutes with nothing logged. Past
// the timeout the coordinator has aborted the transaction, unless the
// commit already reached it, and then only the progress record, committed
// with it, tells; so the sink gives up and the caller re-streams from that
// record either way.
func (t *TxnPublisher) endWait(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, t.cfg.Timeout)
}

// unanswered explains why a wait bounded by endWait ended.
func (t *TxnPublisher) unanswered(ctx, wait context.Context) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return fmt.Errorf("no answer from Kafka within the transaction timeout (%s); check the brokers, above all the one coordinating transactional id %q: %w",
		t.cfg.Timeout, t.cfg.TransactionalID, wait.Err())
}

// fail is abort when waiting itself failed (the caller gave up): the
// producer's state is unknown, so nothing more is sent with it.
func (t *TxnPublisher) fail(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return t.spent(t.report(err, ClassRetriable))
	}
	return t.abort(ctx, err, false)
}

// report reports every record of the transaction failed, once, and returns
// the error the caller's calls get from now on.
func (t *TxnPublisher) report(cause error, class Class) error {
	var err error
	if class == ClassFenced {
		err = fmt.Errorf("%w: %w; stop this instance or let it wait as a standby: another relay with transactional id %q owns the stream", ErrFenced, cause, t.cfg.TransactionalID)
	} else {
		err = fmt.Errorf("%w: %w", ErrTxnAborted, cause)
	}
	for _, r := range t.batch {
		d := failedDelivery(r)
		// No partition: read_committed readers never see an aborted
		// record, so its re-delivery cannot land out of order.
		t.handler.Failed(d, &Error{Class: class, EventID: r.EventID(), Topic: d.Topic, Partition: -1, Err: err})
	}
	t.reset()
	return err
}

func (t *TxnPublisher) reset() {
	if t.broken != nil || t.complete == len(t.batch) {
		t.splitOne = false
	}
	t.open, t.due, t.last = false, false, nil
	t.batch, t.bytes, t.complete = t.batch[:0], 0, 0
	t.progress = false
}

// spent marks the sink unusable and returns err.
func (t *TxnPublisher) spent(err error) error {
	t.broken = err
	return err
}

func (t *TxnPublisher) classify(err error) error {
	if fenced(err) {
		return fmt.Errorf("%w: %w", ErrFenced, err)
	}
	return err
}

// fenced reports whether err says a newer producer took the transactional
// id. Brokers before 2.7 say INVALID_PRODUCER_EPOCH for it.
func fenced(err error) bool {
	return errors.Is(err, ErrFenced) || errors.Is(err, sarama.ErrProducerFenced) || errors.Is(err, sarama.ErrInvalidProducerEpoch)
}

func (t *TxnPublisher) firstFailure() *failure {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.failures) == 0 {
		return nil
	}
	return &t.failures[0]
}

// drain collects the producer's outcomes for the open transaction until the
// producer closes its channels.
func (t *TxnPublisher) drain() {
	defer t.wg.Done()
	successes, errs := t.pub.producer.Successes(), t.pub.producer.Errors()
	for successes != nil || errs != nil {
		select {
		case _, ok := <-successes:
			if !ok {
				successes = nil
				continue
			}
			t.outcome(nil)
		case perr, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			r, _ := perr.Msg.Metadata.(*Record)
			t.outcome(&failure{record: r, err: perr.Err})
		}
	}
}

func (t *TxnPublisher) outcome(f *failure) {
	t.mu.Lock()
	t.outcomes++
	if f != nil {
		t.failures = append(t.failures, *f)
	}
	t.mu.Unlock()
	select {
	case t.changed <- struct{}{}:
	default:
	}
}

// awaitOutcomes waits until the producer reported n outcomes for the open
// transaction.
func (t *TxnPublisher) awaitOutcomes(ctx context.Context, n int) error {
	return t.waitFor(ctx, t.changed, func() bool {
		t.mu.Lock()
		defer t.mu.Unlock()
		return t.outcomes >= n
	})
}

// acquire takes the turn, or gives up when ctx ends.
func (t *TxnPublisher) acquire(ctx context.Context) error {
	select {
	case t.turn <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (t *TxnPublisher) release() { <-t.turn }

// waitFor waits until done reports true, looking whenever wake fires.
func (t *TxnPublisher) waitFor(ctx context.Context, wake <-chan struct{}, done func() bool) error {
	for !done() {
		select {
		case <-wake:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// whileWaiting runs a blocking producer call on its own goroutine so the
// caller can give up when ctx ends. A call given up on keeps running; the
// sink is spent then anyway.
func (t *TxnPublisher) whileWaiting(ctx context.Context, call func() error) error {
	done := make(chan error, 1)
	t.calls.Add(1)
	go func() {
		defer t.calls.Done()
		done <- call()
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// sendWaiting hands a message to the producer, waiting while it is full.
func (t *TxnPublisher) sendWaiting(ctx context.Context, msg *sarama.ProducerMessage) error {
	select {
	case t.pub.producer.Input() <- msg:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// commitOnTime commits a Kafka transaction that reached Interval while the
// read loop has nothing more to send: without it, the last batch before a
// quiet spell would wait for the next event.
func (t *TxnPublisher) commitOnTime() {
	defer t.wg.Done()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		var deadline time.Time
		select {
		case deadline = <-t.armed:
		case <-t.stop:
			return
		}
		timer.Reset(time.Until(deadline))
		select {
		case <-timer.C:
		case <-t.stop:
			timer.Stop()
			return
		}
		select {
		case t.turn <- struct{}{}:
		case <-t.stop:
			return
		}
		if t.open && t.broken == nil && t.deadline.Equal(deadline) {
			if t.complete == len(t.batch) {
				// Failures are reported through the handler and returned
				// by the caller's next call.
				_ = t.commit(context.Background())
			} else {
				t.due = true
			}
		}
		t.release()
	}
}
