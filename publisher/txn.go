package publisher

// The exactly-once sink: records go into Kafka transactions that each hold
// one or more whole source (PostgreSQL) transactions plus the progress
// record of the last of them, so what Kafka committed and where the relay
// resumes can never disagree. Acks are reported only once the Kafka
// transaction committed; a record that fails aborts the transaction and every
// record of it is reported failed, so the caller re-streams from the last
// committed progress.

import (
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/outbox-relay/outbox-relay/sink"
)

// ErrTxnAborted marks the records of an aborted Kafka transaction. None of
// them is visible to read_committed consumers; the caller re-streams them
// from the last committed progress.
var ErrTxnAborted = errors.New("kafka transaction aborted")

// TxnConfig shapes the exactly-once sink. The zero value of every field but
// TransactionalID means its default.
type TxnConfig struct {
	// TransactionalID identifies the producer across restarts; see
	// TransactionalID.
	TransactionalID string

	// Interval is how long a Kafka transaction stays open, from its first
	// record's build, before it commits at the next source-transaction
	// boundary (--transaction-interval); longer while catching up (see
	// commitDeadline). read_committed consumers see nothing of a
	// transaction before it commits, so it adds to their latency; each
	// commit costs a constant (AddPartitionsToTxn, EndTxn, one marker per
	// partition), so it must not be too short either.
	Interval time.Duration

	// BatchEvents and BatchBytes end a Kafka transaction at the next
	// source-transaction boundary once it holds that much. Keep them below
	// the caller's in-flight limits, since acks are held until the commit.
	// The sink holds a transaction's records until its commit, so the
	// events bound is what a catching-up relay's memory follows: 25,000
	// took 73-83 MB peak RSS draining 200,000 single-row transactions on
	// Apache Kafka, 10,000 (with the relay's GOGC of 150 in this mode)
	// 45-48 MB, at the same rate within that run's noise.
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
	// the wait for a commit or an abort to be answered.
	Timeout time.Duration

	// Poison remembers events Kafka refused across sessions. The caller
	// keeps one for the life of the process and passes it to every sink it
	// makes; nil gives this sink a memory of its own.
	Poison *PoisonMemory
}

// DefaultTxnConfig returns the defaults; the caller sets the
// transactional id and the progress record.
func DefaultTxnConfig() TxnConfig {
	return TxnConfig{
		Interval:    sink.DefaultTransactionInterval,
		BatchEvents: 10000,
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

// commitDeadline is when a Kafka transaction begun at began, whose first
// record was built at firstBuilt from a source transaction committed at
// sourceCommit, is due to commit.
//
// On a stream the relay keeps up with, the interval runs from the record's
// build, not the begin: a record that waited out the previous commit would
// otherwise wait that commit, a whole interval and its own commit before
// read_committed consumers see it. The transaction still stays open at
// least half an interval, so records that queued behind a slow commit do
// not make each transaction tiny.
//
// Catching up, when the record's source commit lies more than an interval
// back, the transaction stays open as long as the relay lags, up to
// catchUpInterval: each commit costs a near constant wait on Apache Kafka
// (EndTxn, then AddPartitionsToTxn refused until the previous markers are
// written), and transactions of an interval each spent a third or more of
// a drain on it. At most it doubles how late a lagging event becomes
// visible, and the batch limits end such a transaction sooner at a high
// rate.
//
// A transaction that began catching up ends at the steady deadline after
// all, once a source transaction's end shows the relay caught up (see
// caughtUp): the end of a backlog must not wait out the catch-up interval.
func commitDeadline(firstBuilt, sourceCommit, began time.Time, interval, commitCost time.Duration) time.Time {
	deadline := steadyDeadline(firstBuilt, began, interval, commitCost)
	if lag := began.Sub(sourceCommit); !sourceCommit.IsZero() && lag > interval {
		deadline = maxTime(deadline, began.Add(min(lag, catchUpInterval)))
	}
	return deadline
}

// steadyDeadline is commitDeadline for a relay that keeps up. It comes
// commitCost (what recent commits took) before the interval ends, so a
// record is visible about an interval after its read: on Apache Kafka,
// without this, the p99 at a steady 2,000/s was 127 ms with a 100 ms
// interval.
func steadyDeadline(firstBuilt, began time.Time, interval, commitCost time.Duration) time.Time {
	if firstBuilt.IsZero() || firstBuilt.After(began) {
		firstBuilt = began
	}
	return maxTime(firstBuilt.Add(interval-min(commitCost, interval/2)), began.Add(interval/2))
}

// caughtUp says whether a source transaction committed at commitTime is
// read within an interval of its commit, now.
func caughtUp(commitTime, now time.Time, interval time.Duration) bool {
	return commitTime.IsZero() || now.Sub(commitTime) <= interval
}

// catchUpInterval bounds how long a Kafka transaction stays open while the
// relay catches up; see commitDeadline.
const catchUpInterval = time.Second

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// fenced reports whether err says a newer producer took the transactional
// id. Brokers before 2.7 say INVALID_PRODUCER_EPOCH for it.
func fenced(err error) bool {
	return errors.Is(err, sink.ErrFenced) || errors.Is(err, sarama.ErrProducerFenced) || errors.Is(err, sarama.ErrInvalidProducerEpoch)
}

// failure is a record the producer reported failed.
type failure struct {
	record *Record // nil for the progress record
	err    error
}
