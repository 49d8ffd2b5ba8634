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
const topics = harness.RelayTopics

// env is one test's world: its own database (and so its own slot name),
// a Kafka cluster and the relay binary; a test may point Brokers
// elsewhere.
type env struct{ *harness.Env }

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{harness.NewRelayEnv(t, cluster, 3)}
	e.AdminAddr = "127.0.0.1:0"
	return e
}

// newEnvNoKafka creates the database only; the test sets Brokers.
func newEnvNoKafka(t *testing.T) *env {
	t.Helper()
	e := &env{harness.NewRelayEnv(t, cluster, 0)}
	e.AdminAddr = "127.0.0.1:0"
	return e
}

// argsAs is Args with another DSN.
func (e *env) argsAs(dsn, cmd string, extra ...string) []string {
	return harness.RelayFlags{DSN: dsn, Slot: e.Slot, Brokers: e.Brokers, AdminAddr: e.AdminAddr}.Args(cmd, extra...)
}

// run runs a short command (migrate, status) to its end and returns its
// exit code and output.
func (e *env) run(args []string, envVars ...string) (int, string) {
	e.T.Helper()
	return harness.RunCommand(e.T, e.Bin, args, envVars...)
}

// start starts `outbox-relay run` with args (use e.args) and extra
// environment variables; it does not wait for anything.
func (e *env) start(args []string, envVars ...string) *harness.Process {
	e.T.Helper()
	return harness.StartProcess(e.T, e.Bin, args, envVars)
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
