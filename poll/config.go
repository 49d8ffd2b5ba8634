// Package poll is the relay's other source: for databases where it cannot
// hold a replication slot, it claims unpublished outbox rows from the state
// table beside the outbox (see migrations/poll), publishes them with no lock
// held, and marks each published only after Kafka acknowledged it.
//
// The records, the quarantine table and the error classes are the WAL
// path's own; what differs is where the state lives: per row, in
// PostgreSQL, instead of a position in a slot.
package poll

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// Config is what a poller needs.
type Config struct {
	// Postgres is the database, with Table the outbox table.
	Postgres pg.Config
	// Slot is --slot: a poller refuses to run while a WAL relay streams
	// from it (see pg.CheckNoWALRelay).
	Slot string
	// Sinks makes the sinks events go to.
	Sinks Sinks
	// QuarantineTable is --quarantine-table; empty means the default.
	QuarantineTable string
	// DryRun, when set, makes the poller print instead of publish (`run
	// --dry-run`): it reads the pending rows in the order it would claim
	// them, then the rows that come after, hands their records to DryRun's
	// sink and the events it would quarantine to DryRun, and claims,
	// marks, quarantines and deletes nothing.
	DryRun DryRun

	// Strategy is how a poller finds rows: StrategyLease claims them from
	// the state table, with several pollers at once; StrategySnapshot reads
	// them by transaction snapshots, one poller at a time, with no write
	// per event (see snapshot.go).
	Strategy string

	// WorkerID names this poller in the leases it takes; the default is
	// host:pid, unique among the pollers of one table.
	WorkerID string
	// Batch is how many rows one claim takes.
	Batch int
	// MaxInFlightBytes is --max-in-flight-bytes, the WAL source's bound
	// on what it holds: a claim or a page takes a share of it in bytes,
	// so memory is bounded by it, not by the backlog (see size.go).
	MaxInFlightBytes int64
	// MaxMessageBytes is --max-message-bytes: a row whose values are
	// larger is quarantined by reference, its values never read.
	MaxMessageBytes int
	// Lease is how long a claim keeps other pollers off its rows. It must
	// outlast a publish (see Sinks.Bound): a lease that expires while its
	// rows are still in flight lets another poller publish them too (a
	// duplicate, counted).
	Lease time.Duration
	// Interval is how often an idle poller looks for rows anyway: a
	// notification can be lost, and a row's backoff can end, with no
	// insert to wake anyone.
	Interval time.Duration
	// Tick is the least time between two claims while rows trickle in:
	// commits within it are claimed and sent together, which costs less
	// per event on PostgreSQL and the broker, for up to Tick of latency.
	// A full batch is followed by the next claim at once.
	Tick time.Duration
	// Notify wakes the poller on the trigger's NOTIFY at commit. Off for a
	// connection through a transaction-mode pooler, which does not carry
	// LISTEN.
	Notify bool
	// SessionCheck ties the poller to its PostgreSQL session: each lease
	// names the session that took it, and is free as soon as that session
	// is gone (the poller died), and the session holds a lock that tells a
	// WAL relay a poller runs. Off behind a transaction-mode pooler, whose
	// server sessions are shared and outlive the poller: leases then last
	// until they expire.
	SessionCheck bool
	// MaxAttempts is how many times a retriable failure is tried before
	// the event goes to the quarantine table.
	MaxAttempts int
	// BackoffMin and BackoffMax bound the per-event exponential backoff,
	// with jitter, between attempts.
	BackoffMin, BackoffMax time.Duration
	// OnPermanentError is "quarantine" or "halt", as in WAL mode.
	OnPermanentError string
	// Retention deletes published rows; After zero turns it off.
	Retention store.Retention
	// StatsInterval is how often the pending-rows gauges are refreshed.
	StatsInterval time.Duration
	// ShutdownTimeout bounds the wait for in-flight acks on SIGTERM.
	ShutdownTimeout time.Duration
	// RestartBackoffMin and RestartBackoffMax bound the wait before a new
	// session after PostgreSQL or Kafka failed.
	RestartBackoffMin, RestartBackoffMax time.Duration
}

// DefaultConfig returns poll mode's defaults; the caller fills in the
// database, Kafka and the shared settings.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		Strategy:          StrategyLease,
		WorkerID:          host + ":" + strconv.Itoa(os.Getpid()),
		Batch:             500,
		MaxInFlightBytes:  64 << 20,
		MaxMessageBytes:   64 << 20,
		Lease:             3 * time.Minute,
		Interval:          time.Second,
		Tick:              5 * time.Millisecond,
		Notify:            true,
		SessionCheck:      true,
		MaxAttempts:       10,
		BackoffMin:        time.Second,
		BackoffMax:        5 * time.Minute,
		OnPermanentError:  pipeline.OnPermanentQuarantine,
		Retention:         store.DefaultRetention(),
		StatsInterval:     5 * time.Second,
		ShutdownTimeout:   30 * time.Second,
		RestartBackoffMin: 500 * time.Millisecond,
		RestartBackoffMax: 30 * time.Second,
	}
}

// Validate checks the poll settings and names the flag at fault.
func (c Config) Validate() error {
	if c.Postgres.DSN == "" {
		return errors.New("--pg-dsn is required")
	}
	if _, err := c.tables(); err != nil {
		return err
	}
	if _, err := store.QuarantineTable(c.Postgres.Table, c.QuarantineTable); err != nil {
		return err
	}
	switch c.Strategy {
	case StrategyLease, StrategySnapshot:
	default:
		return fmt.Errorf("--poll-strategy %q: use %s or %s", c.Strategy, StrategyLease, StrategySnapshot)
	}
	switch {
	case c.WorkerID == "":
		return errors.New("--poll-worker-id: must not be empty")
	case c.Batch < 1 || c.Batch > 10000:
		return fmt.Errorf("--poll-batch %d: must be between 1 and 10000", c.Batch)
	case c.Interval <= 0:
		return fmt.Errorf("--poll-interval %s: must be positive", c.Interval)
	case c.Tick < 0 || c.Tick > c.Interval:
		return fmt.Errorf("--poll-tick %s: must be between 0 and --poll-interval (%s)", c.Tick, c.Interval)
	case c.MaxAttempts < 1:
		return fmt.Errorf("--max-attempts %d: must be at least 1", c.MaxAttempts)
	case c.BackoffMin <= 0 || c.BackoffMax < c.BackoffMin:
		return fmt.Errorf("--poll-backoff-min %s, --poll-backoff-max %s: need 0 < min <= max", c.BackoffMin, c.BackoffMax)
	}
	if err := pipeline.ValidateOnPermanent(c.OnPermanentError); err != nil {
		return err
	}
	if err := c.Retention.Validate(); err != nil {
		return err
	}
	if c.Sinks == nil {
		return errors.New("the poller has no sinks to publish to")
	}
	if bound, made := c.Sinks.Bound(); c.Strategy == StrategyLease && c.Lease < 2*bound {
		return fmt.Errorf("--poll-lease %s: must be at least %s, twice the longest a publish can take (%s), or rows still being published are claimed again by another poller",
			c.Lease, 2*bound, made)
	}
	return nil
}

// tables are the tables a poller reads and writes.
type tables struct {
	outbox, state, quarantine store.Table
	// snapshot is the snapshot strategy's progress table.
	snapshot store.Table
}

func (c Config) tables() (tables, error) {
	outbox, err := store.ParseTable("--table", c.Postgres.Table)
	if err != nil {
		return tables{}, err
	}
	state, err := store.PollStateTable(outbox)
	if err != nil {
		return tables{}, err
	}
	quarantine, err := store.QuarantineTable(c.Postgres.Table, c.QuarantineTable)
	if err != nil {
		return tables{}, err
	}
	t := tables{outbox: outbox, state: state, quarantine: quarantine}
	if c.Strategy == StrategySnapshot {
		if t.snapshot, err = store.PollSnapshotTable(outbox); err != nil {
			return tables{}, err
		}
	}
	return t, nil
}

// Sinks makes the poller's sinks; publisher.Kafka is the real one.
type Sinks interface {
	// NewBounded makes a sink whose batches are at most batchLimit bytes
	// and that reports every record within Bound: retrying belongs to the
	// poller, per event, with backoff and a bound on attempts, for a sink
	// that retried for as long as an outage lasts would outlive the
	// lease, and another poller would publish the rows too. abandoned
	// says the poller drops the sink at its first failed record and sends
	// again from what it stored (the snapshot strategy): the sink is then
	// cut off from the brokers at that failure, so that no record queued
	// behind the failed one reaches Kafka before it is sent again.
	NewBounded(batchLimit int, abandoned bool) (sink.Sink, error)
	// Bound is the longest a bounded sink takes to report a record, and
	// how the settings make it, for an error that names them.
	Bound() (time.Duration, string)
	// MaxMessageBytes is the largest record, and batch, the sinks build.
	MaxMessageBytes() int
}

// DryRun is where a dry run's records and refused events go.
type DryRun interface {
	// NewSink makes a session's sink.
	NewSink() (sink.Sink, error)
	// Put takes an event the poller would quarantine.
	Put(ctx context.Context, e store.Quarantined) error
}
