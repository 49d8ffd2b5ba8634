package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// cluster is the PostgreSQL cluster the package's tests share; each test
// gets its own database in it, and so its own slot and publication names.
var cluster *harness.Postgres

func TestMain(m *testing.M) {
	harness.MainWithPostgres(m, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "20s"}},
		func(pg *harness.Postgres) { cluster = pg })
}

// partitions is the partition count of every auto-created topic, so tests
// can compute the partition the Java client would choose.
const partitions = 6

// env is one test's world: a database with the outbox schema, a Kafka
// broker, and the relay binary.
type env struct {
	t     *testing.T
	db    *harness.PGDatabase
	kafka *harness.Kfake
	bin   string
	slot  string

	// Ledger commits the test's events and remembers them in commit order.
	*harness.Ledger
}

func newEnv(t *testing.T) *env {
	t.Helper()
	db, slot := cluster.CreateRelayDatabase(t)
	return &env{
		t: t, db: db, slot: slot, bin: harness.BuildRelay(t),
		kafka:  harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: partitions}),
		Ledger: harness.NewLedger(),
	}
}

// args are the flags every command of the test uses.
func (e *env) args(cmd string, extra ...string) []string {
	return harness.RelayFlags{DSN: e.db.DSN(), Slot: e.slot, Brokers: e.kafka.Brokers(), AdminAddr: "127.0.0.1:0"}.Args(cmd, extra...)
}

// migrate runs `outbox-relay migrate` and fails the test unless it exits 0.
func (e *env) migrate(extra ...string) {
	e.t.Helper()
	harness.Migrate(e.t, e.bin, e.args("migrate", extra...))
}

// startRelay starts `outbox-relay run` and waits until it streams.
func (e *env) startRelay(extra ...string) *harness.Process {
	e.t.Helper()
	return harness.StartStreaming(e.t, e.bin, e.args("run", extra...), harness.LogLevelInfo)
}

func (e *env) startRelayNoWait(extra ...string) *harness.Process {
	e.t.Helper()
	return harness.StartProcess(e.t, e.bin, e.args("run", extra...), []string{harness.LogLevelInfo})
}

// writeEvents commits txns transactions of perTxn events each, spread over
// aggregates aggregates, from one connection so commit order is the order
// written.
func (e *env) writeEvents(conn *pgx.Conn, txns, perTxn, aggregates int) error {
	n := 0
	for i := 0; i < txns; i++ {
		rows := make([]harness.OutboxEvent, perTxn)
		for j := range rows {
			agg := n % aggregates
			rows[j] = harness.NumberedEvent(n, agg, fmt.Sprintf(`{"n": %d, "note": "event %d of aggregate %d"}`, n, n, agg))
			n++
		}
		if err := e.Commit(context.Background(), conn, rows); err != nil {
			return fmt.Errorf("commit txn %d: %w", i, err)
		}
	}
	return nil
}

// consumeAll reads until every committed event is in Kafka, and checks no
// loss and per-aggregate order with the independent client.
func (e *env) consumeAll(timeout time.Duration) []harness.Record {
	e.t.Helper()
	ids, order := e.Committed()
	records := harness.ConsumeEventIDs(e.t, e.kafka.Brokers(), `^outbox\.event\.`, ids, timeout)
	harness.CheckNoLoss(e.t, records, ids)
	harness.CheckPerAggregateOrder(e.t, records, order)
	return records
}

func (e *env) confirmedFlush() string {
	e.t.Helper()
	return e.db.ConfirmedFlushLSN(e.t, e.slot)
}

// outputHas reports whether the process output contains every part.
func outputHas(out string, parts ...string) bool {
	for _, p := range parts {
		if !strings.Contains(out, p) {
			return false
		}
	}
	return true
}
