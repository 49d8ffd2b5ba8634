package e2e

import (
	"context"
	"fmt"
	"os"
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
	pg, _, err := harness.StartPostgresMain(harness.PGOptions{Settings: map[string]string{
		"wal_sender_timeout": "20s",
	}})
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: start postgres: %v\n", err)
		os.Exit(1)
	}
	cluster = pg
	harness.Main(m)
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
	db := cluster.CreateTestDatabase(t)
	e := &env{
		t: t, db: db, bin: harness.BuildRelay(t),
		kafka:  harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: partitions}),
		slot:   db.Name(), // slots are cluster-wide: one per test database
		Ledger: harness.NewLedger(),
	}
	t.Cleanup(func() {
		// Free the cluster-wide slot; a relay still streaming was already
		// killed by its own cleanup, which runs first.
		cluster.Exec(t, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", e.slot)
	})
	return e
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
	return harness.StartStreaming(e.t, e.bin, e.args("run", extra...), logLevelInfo)
}

func (e *env) startRelayNoWait(extra ...string) *harness.Process {
	e.t.Helper()
	return harness.StartProcess(e.t, e.bin, e.args("run", extra...), []string{logLevelInfo})
}

// logLevelInfo keeps the relay's progress lines, which the tests wait on.
const logLevelInfo = "OUTBOX_RELAY_LOG_LEVEL=info"

// writeEvents commits txns transactions of perTxn events each, spread over
// aggregates aggregates, from one connection so commit order is the order
// written.
func (e *env) writeEvents(conn *pgx.Conn, txns, perTxn, aggregates int) error {
	n := 0
	for i := 0; i < txns; i++ {
		rows := make([]harness.OutboxEvent, perTxn)
		for j := range rows {
			agg := n % aggregates
			rows[j] = harness.OutboxEvent{
				AggregateType: []string{"order", "customer", "invoice"}[agg%3],
				AggregateID:   fmt.Sprintf("agg-%d", agg),
				EventType:     "Happened",
				Payload:       fmt.Sprintf(`{"n": %d, "note": "event %d of aggregate %d"}`, n, n, agg),
			}
			if n%5 == 0 {
				rows[j].Headers = fmt.Sprintf(`{"tenant": "t%d", "traceparent": "00-%032x-%016x-01"}`, agg%7, n, n)
			}
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
