package migrations

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// testDatabase starts a server of the test's own, and returns it, a
// database on it and a connection to that database.
func testDatabase(t *testing.T) (*harness.Postgres, *harness.PGDatabase, *pgx.Conn) {
	t.Helper()
	pg := harness.StartPostgres(t, harness.PGOptions{})
	db := pg.CreateTestDatabase(t)
	return pg, db, connect(t, db.DSN())
}

// connect opens a connection the test closes at its end.
func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func TestSQLQuotesNames(t *testing.T) {
	sql, err := SQL(Names{Schema: "sales", Table: `odd"name`, Publication: "pub'x"})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`CREATE TABLE IF NOT EXISTS "sales"."odd""name"`,
		`CONSTRAINT "odd""name_headers_shape" CHECK`,
		`CREATE INDEX IF NOT EXISTS "odd""name_created_at_idx" ON "sales"."odd""name"`,
		`pubname = 'pub''x'`,
		`CREATE PUBLICATION "pub'x" FOR TABLE "sales"."odd""name" WITH (publish = 'insert')`,
		`CREATE TABLE IF NOT EXISTS "sales"."outbox_quarantine"`,
	} {
		if !strings.Contains(sql, want) {
			t.Errorf("SQL lacks %s", want)
		}
	}
	if strings.Contains(sql, "{{") {
		t.Errorf("unreplaced placeholder in:\n%s", sql)
	}
}

// Names that quoting alone cannot make safe are refused by SQL itself, not
// only by the command that calls it: --print-sql once printed whatever it
// was given.
func TestSQLRefusesBadNames(t *testing.T) {
	for _, n := range []Names{
		{Schema: "public", Table: "", Publication: "p"},
		{Schema: "public", Table: strings.Repeat("t", 64), Publication: "p"},
		{Schema: "public", Table: "a\x00b", Publication: "p"},
		{Schema: "public", Table: "t", Publication: "x$migrate$; DROP TABLE t; --"},
		{Schema: "public", Table: "t", Publication: "p", Quarantine: "a.b.c"},
	} {
		if sql, err := SQL(n); err == nil {
			t.Errorf("%+v: accepted:\n%s", n, sql)
		}
	}
	for _, slot := range []string{"x'); select pg_drop_replication_slot('other'); --", "", "Upper", strings.Repeat("s", 64)} {
		if sql, err := SlotSQL(slot); err == nil {
			t.Errorf("slot %q: accepted:\n%s", slot, sql)
		}
	}
	if sql, err := SlotSQL("outbox_relay"); err != nil || !strings.Contains(sql, "pg_create_logical_replication_slot('outbox_relay', 'pgoutput')") {
		t.Errorf("a good slot name: %v\n%s", err, sql)
	}
}

// The SQL for odd names runs on a real server, twice (it must be
// idempotent), and creates exactly the objects named.
func TestSQLAppliesWithOddNames(t *testing.T) {
	_, db, conn := testDatabase(t)
	ctx := context.Background()
	names := Names{Schema: `my schema`, Table: `out"box events`, Publication: `pub 'one'`, Quarantine: `my schema.refused "events"`}
	if _, err := conn.Exec(ctx, `CREATE SCHEMA "my schema"`); err != nil {
		t.Fatal(err)
	}
	// Issue 24.14: migrate said "schema is up to date" after creating
	// everything; Apply now says what it created.
	for i, want := range []int{4, 0} {
		created, err := Apply(ctx, conn, names)
		if err != nil {
			t.Fatalf("apply %d: %v", i+1, err)
		}
		if len(created) != want {
			t.Errorf("apply %d created %q, want %d objects", i+1, created, want)
		}
	}
	for _, c := range []struct{ what, query string }{
		{"outbox table", `SELECT count(*) FROM pg_tables WHERE schemaname = 'my schema' AND tablename = 'out"box events'`},
		{"quarantine table", `SELECT count(*) FROM pg_tables WHERE schemaname = 'my schema' AND tablename = 'refused "events"'`},
		{"headers check", `SELECT count(*) FROM pg_constraint WHERE conname = 'out"box events_headers_shape'`},
		{"created_at index", `SELECT count(*) FROM pg_indexes WHERE indexname = 'out"box events_created_at_idx'`},
		{"publication", `SELECT count(*) FROM pg_publication_tables WHERE pubname = 'pub ''one''' AND tablename = 'out"box events'`},
	} {
		if n := db.QueryInt64(t, c.query); n != 1 {
			t.Errorf("%s: %d found, want 1", c.what, n)
		}
	}
	// Issue 24.6: a quarantine table from before replay kept its events
	// gets the columns that record a replay, and migrate names them.
	if _, err := conn.Exec(ctx, `ALTER TABLE "my schema"."refused ""events""" DROP COLUMN replayed_at, DROP COLUMN replayed_topic`); err != nil {
		t.Fatal(err)
	}
	created, err := Apply(ctx, conn, names)
	if err != nil || len(created) != 1 || !strings.Contains(created[0], "replayed_at, replayed_topic") {
		t.Errorf("apply to a quarantine table without the replay columns: created %q, %v; want the columns named", created, err)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM pg_attribute WHERE attrelid = '"my schema"."refused ""events"""'::regclass
		AND attname IN ('replayed_at', 'replayed_topic') AND NOT attisdropped`); n != 2 {
		t.Errorf("%d replay columns after migrate, want 2", n)
	}
	// A quarantine table from before binary payloads, with an event in
	// it, gets the column that keeps their bytes in place: the event
	// stays as it was.
	if _, err := conn.Exec(ctx, `ALTER TABLE "my schema"."refused ""events""" DROP COLUMN payload_bytes;
		INSERT INTO "my schema"."refused ""events""" (event_id, aggregate_type, aggregate_id, event_type, payload, topic, error_class, error_message)
		VALUES (gen_random_uuid(), 'a', '1', 'e', '{"a": 1}', 't', 'permanent', 'too large')`); err != nil {
		t.Fatal(err)
	}
	created, err = Apply(ctx, conn, names)
	if err != nil || len(created) != 1 || !strings.Contains(created[0], "payload_bytes") {
		t.Errorf("apply to a quarantine table without payload_bytes: created %q, %v; want the column named", created, err)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM "my schema"."refused ""events""" WHERE payload = '{"a": 1}' AND payload_bytes IS NULL`); n != 1 {
		t.Errorf("%d JSON events kept after migrate, want 1", n)
	}
	// Issue 40.2: one from before raw and content_problem gets them.
	if _, err := conn.Exec(ctx, `ALTER TABLE "my schema"."refused ""events""" DROP COLUMN raw, DROP COLUMN raw_size, DROP COLUMN raw_sha256, DROP COLUMN raw_lsn, DROP COLUMN content_problem`); err != nil {
		t.Fatal(err)
	}
	created, err = Apply(ctx, conn, names)
	if err != nil || len(created) != 1 || !strings.Contains(created[0], "raw, raw_size, raw_sha256, raw_lsn, content_problem") {
		t.Errorf("apply to a quarantine table without raw: created %q, %v; want the columns named", created, err)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM pg_attribute WHERE attrelid = '"my schema"."refused ""events"""'::regclass
		AND attname IN ('raw', 'raw_size', 'raw_sha256', 'raw_lsn', 'content_problem') AND NOT attisdropped`); n != 5 {
		t.Errorf("%d raw columns after migrate, want 5", n)
	}
	// The check constraint works under its quoted name.
	_, err = conn.Exec(ctx, `INSERT INTO "my schema"."out""box events" (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
		VALUES (gen_random_uuid(), 'a', '1', 'e', '{}', '{"event_id": "x"}')`)
	if err == nil || !strings.Contains(err.Error(), "headers_shape") {
		t.Errorf("a reserved header name was accepted: %v", err)
	}
}

// For another tool's table (a Debezium outbox) the script makes the
// publication and the quarantine table and never creates or changes the
// outbox table.
func TestSQLForExternalTable(t *testing.T) {
	script, err := SQL(Names{Schema: "public", Table: "outbox", Publication: "outbox_relay", ExternalTable: true})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(script, `TABLE IF NOT EXISTS "public"."outbox"`) || strings.Contains(script, "ON \"public\".\"outbox\" (created_at)") ||
		strings.Contains(script, "ADD COLUMN outbox_relay_seq") {
		t.Fatalf("the script creates or changes the outbox table:\n%s", script)
	}
	for _, want := range []string{`CREATE PUBLICATION "outbox_relay" FOR TABLE "public"."outbox"`, `CREATE TABLE IF NOT EXISTS "public"."outbox_quarantine"`, "ALTER COLUMN payload DROP NOT NULL"} {
		if !strings.Contains(script, want) {
			t.Errorf("the script lacks %s:\n%s", want, script)
		}
	}
	own, err := SQL(Names{Schema: "public", Table: "outbox", Publication: "outbox_relay"})
	if err != nil || !strings.Contains(own, `CREATE TABLE IF NOT EXISTS "public"."outbox" (`) {
		t.Fatalf("the relay's own layout no longer creates its table (%v)", err)
	}
}

// The snapshot strategy's migration (issue 43) on a table with rows: it
// adds the two columns without rewriting the table (its file stays the
// same), gives new rows a transaction id and a sequence number, counts
// the rows from before as pending, and a writer with INSERT on the outbox
// alone can still insert. Applied again, it creates nothing and keeps the
// progress; PollQuiet takes the NOTIFY trigger off.
func TestSQLForPollSnapshot(t *testing.T) {
	pg, db, conn := testDatabase(t)
	ctx := context.Background()
	names := Names{Schema: `my schema`, Table: `out"box`, Publication: `pub`}
	if _, err := conn.Exec(ctx, `CREATE SCHEMA "my schema"`); err != nil {
		t.Fatal(err)
	}
	if _, err := Apply(ctx, conn, names); err != nil {
		t.Fatal(err)
	}
	table := `"my schema"."out""box"`
	db.Exec(t, `INSERT INTO `+table+` (event_id, aggregate_type, aggregate_id, event_type, payload) SELECT gen_random_uuid(), 'a', i::text, 'e', '{}' FROM generate_series(1, 100) i`)
	file := db.QueryString(t, `SELECT pg_relation_filenode('`+table+`')::text`)

	names.PollSnapshot = true
	created, err := Apply(ctx, conn, names)
	if err != nil {
		t.Fatal(err)
	}
	if len(created) != 4 || !strings.Contains(created[3], "100 rows already in the outbox pending") {
		t.Errorf("created %q: want the columns, the progress table, the trigger and the 100 rows from before named", created)
	}
	if got := db.QueryString(t, `SELECT pg_relation_filenode('`+table+`')::text`); got != file {
		t.Errorf("the table's file went from %s to %s: adding the columns rewrote it", file, got)
	}
	db.Exec(t, `CREATE ROLE writer_only LOGIN; GRANT USAGE ON SCHEMA "my schema" TO writer_only; GRANT INSERT ON `+table+` TO writer_only`)
	if _, err := connect(t, pg.DSNFor("writer_only", "", db.Name())).Exec(ctx, `INSERT INTO `+table+` (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), 'a', 'w', 'e', '{}')`); err != nil {
		t.Fatalf("a writer with INSERT on the outbox alone: %v", err)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM `+table+` WHERE outbox_relay_xid IS NOT NULL AND outbox_relay_seq IS NOT NULL`); n != 1 {
		t.Errorf("%d new rows with a transaction id and a sequence number, want 1", n)
	}
	if db.QueryString(t, `SELECT existing_pending::text FROM "my schema"."out""box_poll_snapshot"`) != "true" {
		t.Errorf("the rows from before are not pending in the progress row")
	}
	db.Exec(t, `UPDATE "my schema"."out""box_poll_snapshot" SET existing_pending = false`)

	names.PollQuiet = true
	created, err = Apply(ctx, conn, names)
	if err != nil || len(created) != 0 {
		t.Errorf("applied again: created %q, %v; want nothing", created, err)
	}
	if db.QueryString(t, `SELECT existing_pending::text FROM "my schema"."out""box_poll_snapshot"`) != "false" {
		t.Errorf("applying again reset the progress row")
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM pg_trigger WHERE tgname = 'out"box_poll_snapshot_notify'`); n != 0 {
		t.Errorf("PollQuiet left the NOTIFY trigger on")
	}
}

// Issue 42: an outbox table from before its rows were numbered gets the
// order column without a rewrite (its file stays the same), rows from
// before keep NULL, new rows are numbered in insertion order, and a
// writer with INSERT on the outbox alone can still insert. A column the
// snapshot strategy numbered with its own sequence keeps that sequence:
// starting over from another would break the order it holds.
func TestOrderColumnOnAnOlderTable(t *testing.T) {
	pg, db, conn := testDatabase(t)
	ctx := context.Background()
	names := Names{Schema: "public", Table: "outbox", Publication: "pub"}
	if _, err := Apply(ctx, conn, names); err != nil {
		t.Fatal(err)
	}
	// The table as migrate left it before the column existed (and the
	// trigger that sets it).
	db.Exec(t, `DROP TRIGGER outbox_outbox_relay_stamp ON outbox; DROP FUNCTION outbox_outbox_relay_stamp(); ALTER TABLE outbox DROP COLUMN outbox_relay_seq`)
	if n := db.QueryInt64(t, `SELECT count(*) FROM pg_class WHERE relname = 'outbox_outbox_relay_seq'`); n != 0 {
		t.Fatalf("dropping the column left its sequence behind")
	}
	insert := `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) SELECT gen_random_uuid(), 'a', i::text, 'e', '{}' FROM generate_series(1, 3) i`
	db.Exec(t, insert)
	file := db.QueryString(t, `SELECT pg_relation_filenode('outbox')::text`)

	// A writer's open transaction holds the change off; with a lock
	// timeout migrate gives up, changes nothing, and says what to do.
	open, err := connect(t, db.DSN()).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := open.Exec(ctx, insert); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "SET lock_timeout = '200ms'"); err != nil {
		t.Fatal(err)
	}
	if _, err := Apply(ctx, conn, names); err == nil || !strings.Contains(err.Error(), "lock_timeout ran out") || !strings.Contains(err.Error(), "run migrate again") {
		t.Fatalf("migrate behind a writer's open transaction: %v; want the lock timeout explained", err)
	}
	if err := open.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM pg_attribute WHERE attrelid = 'outbox'::regclass AND attname = 'outbox_relay_seq' AND NOT attisdropped`); n != 0 {
		t.Fatalf("the migrate that gave up left the column behind")
	}

	created, err := Apply(ctx, conn, names)
	if err != nil {
		t.Fatal(err)
	}
	if len(created) != 1 || created[0] != "column outbox_relay_seq of public.outbox" {
		t.Errorf("created %q: want the order column alone", created)
	}
	if got := db.QueryString(t, `SELECT pg_relation_filenode('outbox')::text`); got != file {
		t.Errorf("the table's file went from %s to %s: adding the column rewrote it", file, got)
	}
	db.Exec(t, `CREATE ROLE writer_only LOGIN; GRANT INSERT ON outbox TO writer_only`)
	if _, err := connect(t, pg.DSNFor("writer_only", "", db.Name())).Exec(ctx, insert); err != nil {
		t.Fatalf("a writer with INSERT on the outbox alone: %v", err)
	}
	// The default takes a number, then the trigger that sets the column
	// whatever the INSERT said takes the next: the numbers order the rows,
	// and their gaps mean nothing.
	if got := db.QueryString(t, `SELECT string_agg(coalesce(outbox_relay_seq::text, '-'), ',' ORDER BY ctid) FROM outbox`); got != "-,-,-,-,-,-,2,4,6" {
		t.Errorf("order column %s, want the 6 rows from before unnumbered and the 3 new ones numbered in insertion order", got)
	}

	// A snapshot strategy deployment whose column came from its own sequence.
	db.Exec(t, `CREATE SEQUENCE outbox_poll_snapshot_seq START 1000;
		ALTER TABLE outbox ALTER COLUMN outbox_relay_seq SET DEFAULT nextval('outbox_poll_snapshot_seq')`)
	names.PollSnapshot = true
	if _, err := Apply(ctx, conn, names); err != nil {
		t.Fatal(err)
	}
	if got := db.QueryString(t, `SELECT pg_get_expr(adbin, adrelid) FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
		WHERE d.adrelid = 'outbox'::regclass AND a.attname = 'outbox_relay_seq'`); got != "nextval('outbox_poll_snapshot_seq'::regclass)" {
		t.Errorf("the order column's default became %s: a numbered column must keep its sequence", got)
	}
}
