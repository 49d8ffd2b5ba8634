package harness

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// RelayTopics matches every topic the relay writes with its default
// topic template.
const RelayTopics = `^outbox\.event\.`

// Env is one test's world in the packages that run the relay binary: a
// database (with the slot name its relay uses), a Kafka, the relay binary,
// and the Ledger of what the test committed. Each package's env embeds it
// and adds only what its tests do differently.
type Env struct {
	T    *testing.T
	DB   *PGDatabase
	Bin  string
	Slot string // "" for a source that reads no slot
	// Source is the --source every command of the test gets; "" leaves
	// the relay's default.
	Source string
	// Kafka is the test's kfake; nil when the test brings its own Kafka
	// and sets Brokers.
	Kafka   *Kfake
	Brokers []string // what --kafka-brokers gets
	// AdminAddr is run's --admin-addr (see RelayFlags).
	AdminAddr string
	*Ledger
}

// NewEnv is an Env on db, whose relay uses slot, with a kfake of
// partitions partitions per auto-created topic; partitions 0 starts no
// Kafka.
func NewEnv(t *testing.T, db *PGDatabase, slot string, partitions int32) *Env {
	t.Helper()
	e := &Env{T: t, DB: db, Slot: slot, Bin: BuildRelay(t), Ledger: NewLedger()}
	if partitions > 0 {
		e.Kafka = StartKfakeWith(t, KfakeOptions{Partitions: partitions})
		e.Brokers = e.Kafka.Brokers()
	}
	return e
}

// NewRelayEnv is NewEnv on a new database of pg with the outbox schema and
// a slot name of its own (see CreateRelayDatabase).
func NewRelayEnv(t *testing.T, pg *Postgres, partitions int32) *Env {
	t.Helper()
	db, slot := pg.CreateRelayDatabase(t)
	return NewEnv(t, db, slot, partitions)
}

// SourceArgs puts the Env's --source before extra.
func (e *Env) SourceArgs(extra ...string) []string {
	if e.Source == "" {
		return extra
	}
	return append([]string{"--source", e.Source}, extra...)
}

// Args is cmd's command line for the Env (see RelayFlags.Args), with its
// --source, then extra.
func (e *Env) Args(cmd string, extra ...string) []string {
	return RelayFlags{DSN: e.DB.DSN(), Slot: e.Slot, Brokers: e.Brokers, AdminAddr: e.AdminAddr}.Args(cmd, e.SourceArgs(extra...)...)
}

// StartRelay starts `outbox-relay run` with extra and waits until it
// streams.
func (e *Env) StartRelay(extra ...string) *Process {
	e.T.Helper()
	return StartStreaming(e.T, e.Bin, e.Args("run", extra...), LogLevelInfo)
}

// StartRelayNoWait starts `outbox-relay run` with extra, and waits for
// nothing.
func (e *Env) StartRelayNoWait(extra ...string) *Process {
	e.T.Helper()
	return StartProcess(e.T, e.Bin, e.Args("run", extra...), []string{LogLevelInfo})
}

// Migrate runs `outbox-relay migrate` for the Env's source on its database
// directly (never through a proxy the relay may be given), with extra, and
// fails the test unless it exits 0.
func (e *Env) Migrate(extra ...string) {
	e.T.Helper()
	args := []string{"migrate", "--pg-dsn", e.DB.DSN()}
	if e.Slot != "" {
		args = append(args, "--slot", e.Slot)
	}
	Migrate(e.T, e.Bin, append(args, e.SourceArgs(extra...)...))
}

// WriteNumbered commits txns transactions of perTxn numbered events each
// (see NumberedEvent), the first numbered first, spread over aggregates
// aggregates, from one connection so commit order is the order written.
// payload makes event n's payload.
func (e *Env) WriteNumbered(conn *pgx.Conn, first, txns, perTxn, aggregates int, payload func(n, agg int) string) error {
	n := first
	for i := 0; i < txns; i++ {
		rows := make([]OutboxEvent, perTxn)
		for j := range rows {
			agg := n % aggregates
			rows[j] = NumberedEvent(n, agg, payload(n, agg))
			n++
		}
		if err := e.Commit(context.Background(), conn, rows); err != nil {
			return fmt.Errorf("commit txn %d: %w", i, err)
		}
	}
	return nil
}

// ConsumeAll reads the relay's default topics with the independent client
// until every committed event is there, and checks no loss and the order
// of first delivery per aggregate.
func (e *Env) ConsumeAll(timeout time.Duration) []Record {
	e.T.Helper()
	ids, order := e.Committed()
	records := ConsumeEventIDs(e.T, e.Brokers, RelayTopics, ids, timeout)
	CheckNoLoss(e.T, records, ids)
	CheckPerAggregateOrder(e.T, records, order)
	return records
}

// ConfirmedFlush is the slot's confirmed_flush_lsn.
func (e *Env) ConfirmedFlush() string {
	e.T.Helper()
	return e.DB.ConfirmedFlushLSN(e.T, e.Slot)
}
