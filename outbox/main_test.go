package outbox_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// pg is the package's PostgreSQL cluster. Its postgres database holds the
// outbox table for the examples, which find it through DATABASE_URL as a
// service would; tests take databases of their own.
var pg *harness.Postgres

func TestMain(m *testing.M) {
	p, _, err := harness.StartPostgresMain(harness.PGOptions{})
	if err == nil {
		err = migrate(p.DSN("postgres"))
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "outbox tests: %v\n", err)
		os.Exit(1)
	}
	pg = p
	os.Setenv("DATABASE_URL", p.DSN("postgres"))
	harness.Main(m)
}

func migrate(dsn string) error {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = migrations.Apply(ctx, conn, migrations.Names{Schema: "public", Table: "outbox_events", Publication: "outbox_relay"})
	return err
}

// migratedDB is a database of the test's own with the outbox table.
func migratedDB(t *testing.T) *harness.PGDatabase {
	t.Helper()
	db := pg.CreateTestDatabase(t)
	if err := migrate(db.DSN()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return db
}

// slotDB is a migrated database with a test_decoding slot, dropped when
// the test ends, whose messages emitted reads.
func slotDB(t *testing.T, slot string) *harness.PGDatabase {
	t.Helper()
	db := migratedDB(t)
	db.Exec(t, "SELECT pg_create_logical_replication_slot($1, 'test_decoding')", slot)
	t.Cleanup(func() { db.Exec(t, "SELECT pg_drop_replication_slot($1)", slot) })
	return db
}
