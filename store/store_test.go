package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/store"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// cluster is the PostgreSQL the package's tests share, started on first
// use; each test takes a database of its own.
var cluster harness.SharedPostgres

// migrated returns a fresh database with the relay's schema.
func migrated(t *testing.T) *harness.PGDatabase {
	t.Helper()
	db := cluster.Get(t).CreateTestDatabase(t)
	script, err := migrations.SQL(migrations.Names{Schema: "public", Table: "outbox_events", Publication: "outbox_relay"})
	if err != nil {
		t.Fatal(err)
	}
	db.Exec(t, script)
	return db
}

func TestQuarantineTableName(t *testing.T) {
	for _, c := range []struct {
		outbox, configured string
		want               store.Table
	}{
		{"app.outbox_events", "", store.Table{Schema: "app", Name: "outbox_quarantine"}},
		{"outbox_events", "", store.Table{Schema: "public", Name: "outbox_quarantine"}},
		{"app.outbox_events", "ops.refused", store.Table{Schema: "ops", Name: "refused"}},
		{"app.outbox_events", "refused", store.Table{Schema: "public", Name: "refused"}},
	} {
		got, err := store.QuarantineTable(c.outbox, c.configured)
		if err != nil || got != c.want {
			t.Errorf("QuarantineTable(%q, %q) = %v, %v; want %v", c.outbox, c.configured, got, err, c.want)
		}
	}
	// The error names the flag at fault, not --table for both.
	if _, err := store.QuarantineTable("app.outbox_events", "a.b.c"); err == nil || !strings.Contains(err.Error(), "--quarantine-table") {
		t.Errorf("a bad --quarantine-table: %v", err)
	}
	if got := (store.Table{Schema: `my "s"`, Name: "t x"}).Quoted(); got != `"my ""s"""."t x"` {
		t.Errorf("Quoted: %s", got)
	}
}

// Issue 11.15: `quarantine list --json` printed Go field names (EventID)
// while /slot uses snake_case.
func TestQuarantinedJSONIsSnakeCase(t *testing.T) {
	b, err := json.Marshal(store.Quarantined{Stored: event.Stored{EventID: "e"}, ErrorClass: "permanent"})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"event_id":"e"`, `"error_class":"permanent"`, `"first_failed_at"`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("%s lacks %s", b, want)
		}
	}
	if regexp.MustCompile(`"[A-Z]`).Match(b) {
		t.Errorf("Go field names in %s", b)
	}
}

// Issue 11.7: a role without a grant on the quarantine table stalled the
// relay for good at the first refused event. Open refuses at start-up and
// names the GRANT, and that GRANT is enough.
func TestOpenQuarantineNamesTheMissingGrant(t *testing.T) {
	db := migrated(t)
	db.Exec(t, "CREATE ROLE quarantine_user LOGIN")
	cfg := pg.Config{DSN: db.DSNFor("quarantine_user", ""), Table: "public.outbox_events"}
	table := store.Table{Schema: "public", Name: store.DefaultQuarantineName}
	ctx := context.Background()
	for _, access := range []store.Access{store.ForRelay, store.ForReplay} {
		_, err := store.OpenQuarantine(ctx, cfg, table, access)
		if !errors.Is(err, pg.ErrPrecondition) {
			t.Fatalf("access %d without grants: %v, want a precondition error", access, err)
		}
		grant := regexp.MustCompile(`GRANT [A-Z, ]+ ON \S+ TO \S+;`).FindString(err.Error())
		if grant == "" {
			t.Fatalf("access %d: the error names no GRANT: %v", access, err)
		}
		db.Exec(t, strings.TrimSuffix(grant, ";"))
		q, err := store.OpenQuarantine(ctx, cfg, table, access)
		if err != nil {
			t.Fatalf("access %d after %s: %v", access, grant, err)
		}
		q.Close()
		// Replay's grant is a subset of the relay's: start each access bare.
		db.Exec(t, "REVOKE ALL ON outbox_quarantine FROM quarantine_user")
	}
}

// Issue 11.7: a quarantine table whose payload is jsonb cannot hold a text
// outbox payload that is not JSON; Open says so at start-up. With a text
// payload column the event is stored as it is, and a jsonb one still takes
// JSON.
func TestQuarantinePayloadColumnFitsTheOutbox(t *testing.T) {
	db := migrated(t)
	db.Exec(t, "ALTER TABLE outbox_events ALTER COLUMN payload TYPE text")
	cfg := pg.Config{DSN: db.DSN(), Table: "public.outbox_events"}
	table := store.Table{Schema: "public", Name: store.DefaultQuarantineName}
	ctx := context.Background()
	_, err := store.OpenQuarantine(ctx, cfg, table, store.ForRelay)
	if !errors.Is(err, pg.ErrPrecondition) || !strings.Contains(err.Error(), "ALTER COLUMN payload TYPE text") {
		t.Fatalf("text outbox payload, jsonb quarantine payload: %v", err)
	}
	db.Exec(t, `ALTER TABLE outbox_quarantine ALTER COLUMN payload TYPE text`)
	q, err := store.OpenQuarantine(ctx, cfg, table, store.ForRelay)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	e := store.Quarantined{Stored: event.Stored{EventID: harness.NewUUID(), AggregateType: "order", AggregateID: "1", EventType: "created",
		Payload: "not JSON at all"}, Topic: "t", ErrorClass: "permanent", ErrorMessage: "too large"}
	if err := q.Put(ctx, e); err != nil {
		t.Fatalf("Put a non-JSON payload into a text column: %v", err)
	}
	if err := q.Put(ctx, e); err != nil {
		t.Fatalf("Put it again: %v", err)
	}
	got, err := q.List(ctx, store.Selection{EventID: e.EventID})
	if err != nil || len(got) != 1 || got[0].Payload != e.Payload || got[0].Attempts != 2 {
		t.Fatalf("List: %+v, %v; want the payload as stored, 2 attempts", got, err)
	}
	if n, err := q.Count(ctx); err != nil || n != 1 {
		t.Fatalf("Count: %d, %v", n, err)
	}
	if err := q.MarkReplayed(ctx, e.EventID, "t2"); err != nil {
		t.Fatal(err)
	}
	if n, err := q.Count(ctx); err != nil || n != 0 {
		t.Fatalf("Count after MarkReplayed: %d, %v", n, err)
	}
}

// Issue 24.15: `quarantine list` against a missing quarantine table
// suggested --on-permanent-error, a flag of run only.
func TestMissingQuarantineTableAdviceFitsTheCommand(t *testing.T) {
	db := migrated(t)
	cfg := pg.Config{DSN: db.DSN(), Table: "public.outbox_events"}
	table := store.Table{Schema: "public", Name: "no_such_quarantine"}
	ctx := context.Background()
	for access, want := range map[store.Access]string{
		store.ForRelay: "--on-permanent-error halt", store.ForList: "--quarantine-table", store.ForReplay: "--quarantine-table",
	} {
		_, err := store.OpenQuarantine(ctx, cfg, table, access)
		if err == nil || !strings.Contains(err.Error(), want) || access != store.ForRelay && strings.Contains(err.Error(), "--on-permanent-error") {
			t.Errorf("access %d: %v, want advice naming %s only", access, err, want)
		}
	}
}
