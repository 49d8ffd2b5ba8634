// Package poll_test tests poll mode (`run --source poll`) end to end: the
// relay binary against a private PostgreSQL and kfake, read back with an
// independent Kafka client.
package poll_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// cluster is the PostgreSQL cluster the package's tests share; each test
// gets its own database.
var cluster *harness.Postgres

func TestMain(m *testing.M) {
	// Prepared transactions: the snapshot strategy's tests prepare some.
	harness.MainWithPostgres(m, harness.PGOptions{Settings: map[string]string{"max_prepared_transactions": "10"}}, func(pg *harness.Postgres) { cluster = pg })
}

// partitions is the partition count of every auto-created topic.
const partitions = 6

// env is one test's world: a database migrated for poll mode, a broker,
// and the relay binary.
type env struct{ *harness.Env }

func newEnv(t *testing.T) *env {
	t.Helper()
	return newEnvOn(t, cluster.CreateTestDatabase(t))
}

// newEnvOn is newEnv on db.
func newEnvOn(t *testing.T, db *harness.PGDatabase) *env {
	t.Helper()
	e := &env{harness.NewEnv(t, db, "", partitions)}
	e.Source = "poll"
	e.Migrate()
	return e
}

// pollArgs is `run --source poll` for this test's database and broker,
// with short timings so failures are retried within a test's time.
func (e *env) pollArgs(extra ...string) []string {
	args := []string{"run", "--source", "poll", "--pg-dsn", e.DB.DSN(), "--kafka-brokers", e.Kafka.BrokerList(),
		"--admin-addr", "127.0.0.1:0", "--kafka-timeout", "2s", "--kafka-retry-backoff-max", "1s", "--poll-lease", "10s",
		"--poll-backoff-min", "100ms", "--poll-backoff-max", "1s", "--shutdown-timeout", "5s"}
	return append(args, extra...)
}

// startPoller starts a poller and waits until it polls.
func (e *env) startPoller(extra ...string) *harness.Process {
	e.T.Helper()
	p := harness.StartProcess(e.T, e.Bin, e.pollArgs(extra...), []string{harness.LogLevelInfo})
	p.WaitForOutput(e.T, `"message":"polling"`, time.Minute)
	return p
}

// writeEvents commits txns transactions of perTxn events each, spread over
// aggregates aggregates, numbered on from the events already committed.
func (e *env) writeEvents(conn *pgx.Conn, txns, perTxn, aggregates int) {
	e.T.Helper()
	err := e.WriteNumbered(conn, e.CommittedCount(), txns, perTxn, aggregates, func(n, _ int) string { return fmt.Sprintf(`{"n": %d}`, n) })
	if err != nil {
		e.T.Fatal(err)
	}
}

// unpublished counts the state rows not published yet.
func (e *env) unpublished() int64 {
	e.T.Helper()
	return e.DB.QueryInt64(e.T, "SELECT count(*) FROM outbox_events_poll WHERE published_at IS NULL")
}

// claims is how many claim statements the poller ran, found rows or not.
func claims(t *testing.T, p *harness.Process) float64 {
	t.Helper()
	families := harness.Scrape(t, p.AdminURL(t))
	rows, _ := harness.MetricValue(families, "outbox_relay_poll_claims_total", "result", "rows")
	empty, _ := harness.MetricValue(families, "outbox_relay_poll_claims_total", "result", "empty")
	return rows + empty
}

// waitClaims waits until the poller ran n more claims than now: what the
// table held meanwhile was looked at n times.
func waitClaims(t *testing.T, p *harness.Process, n float64) {
	t.Helper()
	start := claims(t, p)
	harness.WaitFor(t, time.Minute, fmt.Sprintf("%v more claims", n), func() bool { return claims(t, p) >= start+n })
}

// checkQuarantineAttempts checks that the poller's "event quarantined" log
// line and `quarantine list --json` give the event the same attempts, want.
func (e *env) checkQuarantineAttempts(p *harness.Process, eventID string, want int) {
	e.T.Helper()
	logged := ""
	// The poller logs the quarantine after its row committed, so a test
	// that saw the row may get here before the line.
	harness.WaitFor(e.T, 30*time.Second, "the poller logs the quarantine of "+eventID, func() bool {
		for _, l := range harness.LogLines(p.Output()) {
			if strings.HasPrefix(l.Str("message"), "event quarantined") && l.Str("event_id") == eventID {
				logged = l.Str("attempts")
			}
		}
		return logged != ""
	})
	code, out := harness.RunCommand(e.T, e.Bin, []string{"quarantine", "list", "--json", "--pg-dsn", e.DB.DSN()})
	if code != 0 {
		e.T.Fatalf("quarantine list exited %d:\n%s", code, out)
	}
	var listed []struct {
		EventID  string `json:"event_id"`
		Attempts int    `json:"attempts"`
	}
	if err := json.Unmarshal([]byte(out[strings.Index(out, "["):]), &listed); err != nil {
		e.T.Fatalf("quarantine list --json: %v\n%s", err, out)
	}
	listedAttempts := -1
	for _, q := range listed {
		if q.EventID == eventID {
			listedAttempts = q.Attempts
		}
	}
	if logged != fmt.Sprint(want) || listedAttempts != want {
		e.T.Errorf("event %s: the log says \"attempts\":%s and quarantine list says %d; want both %d", eventID, logged, listedAttempts, want)
	}
}
