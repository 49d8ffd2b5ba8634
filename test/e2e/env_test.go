package e2e

import (
	"fmt"
	"strings"
	"testing"

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
type env struct{ *harness.Env }

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{harness.NewRelayEnv(t, cluster, partitions)}
	e.AdminAddr = "127.0.0.1:0"
	return e
}

// writeEvents commits txns transactions of perTxn events each, spread over
// aggregates aggregates, numbered from 0.
func (e *env) writeEvents(conn *pgx.Conn, txns, perTxn, aggregates int) error {
	return e.WriteNumbered(conn, 0, txns, perTxn, aggregates, func(n, agg int) string {
		return fmt.Sprintf(`{"n": %d, "note": "event %d of aggregate %d"}`, n, n, agg)
	})
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
