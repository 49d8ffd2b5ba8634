package ops

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// topics matches every topic the relay writes with its default template.
const topics = `^outbox\.event\.`

// env is one test's world: its own database (and so its own slot name),
// a Kafka cluster and the relay binary.
type env struct {
	t       *testing.T
	db      *harness.PGDatabase
	bin     string
	slot    string
	brokers []string // what --kafka-brokers gets
	kafka   *harness.Kfake
}

// newEnv creates a database and, unless brokers is given, starts a plain
// kfake cluster.
func newEnv(t *testing.T) *env {
	t.Helper()
	e := newEnvNoKafka(t)
	e.kafka = harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: 3})
	e.brokers = e.kafka.Brokers()
	return e
}

// newEnvNoKafka creates the database only; the test sets brokers.
func newEnvNoKafka(t *testing.T) *env {
	t.Helper()
	db, slot := cluster.CreateRelayDatabase(t)
	return &env{t: t, db: db, bin: harness.BuildRelay(t), slot: slot}
}

// args are a command's flags for this env, connecting as the superuser.
func (e *env) args(cmd string, extra ...string) []string {
	return e.argsAs(e.db.DSN(), cmd, extra...)
}

// argsAs is args with another DSN.
func (e *env) argsAs(dsn, cmd string, extra ...string) []string {
	return harness.RelayFlags{DSN: dsn, Slot: e.slot, Brokers: e.brokers, AdminAddr: "127.0.0.1:0"}.Args(cmd, extra...)
}

// run runs a short command (migrate, status) to its end and returns its
// exit code and output.
func (e *env) run(args []string, envVars ...string) (int, string) {
	e.t.Helper()
	return harness.RunCommand(e.t, e.bin, args, envVars...)
}

// migrate runs `outbox-relay migrate` as the superuser and fails the test
// unless it exits 0.
func (e *env) migrate(extra ...string) {
	e.t.Helper()
	harness.Migrate(e.t, e.bin, e.args("migrate", extra...))
}

// start starts `outbox-relay run` with args (use e.args) and extra
// environment variables; it does not wait for anything.
func (e *env) start(args []string, envVars ...string) *harness.Process {
	e.t.Helper()
	return harness.StartProcess(e.t, e.bin, args, envVars)
}

// startStreaming starts the relay and waits until it streams.
func (e *env) startStreaming(extra ...string) *harness.Process {
	e.t.Helper()
	return harness.StartStreaming(e.t, e.bin, e.args("run", extra...))
}

// insert commits n outbox events, one transaction each, for aggregate
// type aggType, and returns their event ids.
func insert(t *testing.T, dsn string, aggType string, n int) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("connect to insert events: %v", err)
	}
	defer conn.Close(context.Background())
	ids := make([]string, n)
	for i := range ids {
		ids[i] = harness.NewUUID()
		if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
			VALUES ($1, $2, $3, 'Happened', $4::jsonb)`, ids[i], aggType, fmt.Sprintf("agg-%d", i%7), fmt.Sprintf(`{"n": %d}`, i)); err != nil {
			t.Fatalf("insert event %d: %v", i, err)
		}
	}
	return ids
}
