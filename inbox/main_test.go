package inbox_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// pg is the package's PostgreSQL cluster. Its postgres database holds the
// inbox tables for the examples, which find it through DATABASE_URL as a
// service would; tests take databases of their own.
var pg *harness.Postgres

func TestMain(m *testing.M) {
	p, _, err := harness.StartPostgresMain(harness.PGOptions{})
	if err == nil {
		err = createTables(p.DSN("postgres"))
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "inbox tests: %v\n", err)
		os.Exit(1)
	}
	pg = p
	os.Setenv("DATABASE_URL", p.DSN("postgres"))
	harness.Main(m)
}

// createTables applies the inbox's SQL and a side-effect table the tests'
// handlers write to.
func createTables(dsn string) error {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	ddl, err := inbox.SQL(inbox.Tables{})
	if err != nil {
		return err
	}
	_, err = conn.Exec(ctx, ddl+`CREATE TABLE IF NOT EXISTS effects (
		seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text, version bigint)`)
	return err
}
