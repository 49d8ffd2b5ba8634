package store_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"regexp"
	"strconv"
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

// openForRelay opens db's default quarantine table as the relay does,
// closed when the test ends.
func openForRelay(t *testing.T, db *harness.PGDatabase) *store.Quarantine {
	t.Helper()
	q, err := store.OpenQuarantine(context.Background(), pg.Config{DSN: db.DSN(), Table: "public.outbox_events"},
		store.Table{Schema: "public", Name: store.DefaultQuarantineName}, store.ForRelay)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { q.Close() })
	return q
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

// Issue 40.2: a content PostgreSQL cannot store as text or jsonb (U+0000
// escaped in a jsonb payload or headers, a 0x00 byte or invalid UTF-8 in a
// text value) failed the quarantine write, which stopped every messages
// relay of the database at every start. Put stores every such row: the
// values escaped or left out, the original in raw with its size and
// digest, and content_problem and error_message saying what was changed.
func TestPutStoresWhateverTheContent(t *testing.T) {
	q := openForRelay(t, migrated(t))
	ctx := context.Background()
	valid := func(agg, payload string) event.Stored {
		return event.Stored{EventID: harness.NewUUID(), AggregateType: agg, AggregateID: "1", EventType: "created", SchemaVersion: "1", Payload: payload}
	}
	nulPayload := `{"event_id":"nope","payload":{"s":"a\u0000b"}}`
	for _, c := range []struct {
		name    string
		e       store.Quarantined
		changed []string // what content_problem must name
		raw     string   // "" : the event's fields as JSON
		check   func(t *testing.T, got store.Quarantined)
	}{
		{name: "U+0000 in a jsonb payload, a content that is no event", e: store.Quarantined{
			Stored: valid("", `{"s":"a\u0000b"}`), Raw: []byte(nulPayload), RawLSN: 0x16B3748,
			ContentProblem: `message content is not an outbox event: event_id "nope" is not a UUID`},
			changed: []string{"is not a UUID", "unsupported Unicode escape sequence", "payload (as a JSON string of its text)", "raw holds the original"}, raw: nulPayload,
			check: func(t *testing.T, got store.Quarantined) {
				var text string
				if err := json.Unmarshal([]byte(got.Payload), &text); err != nil || text != `{"s":"a\u0000b"}` {
					t.Errorf("payload %q, want the original's text as a JSON string", got.Payload)
				}
				if got.RawLSN != 0x16B3748 {
					t.Errorf("raw_lsn %s", got.RawLSN)
				}
			}},
		{name: "a 0x00 byte in aggregate_type and the topic", e: store.Quarantined{
			Stored: valid("a\x00b", `{"ok": 1}`), Raw: []byte(`{"aggregate_type":"a\u0000b"}`), Topic: "outbox.event.a\x00b",
			ErrorMessage: "invalid topic name \"outbox.event.a\x00b\""},
			changed: []string{"invalid byte sequence", "aggregate_type (Go-quoted)", "topic (Go-quoted)"}, raw: `{"aggregate_type":"a\u0000b"}`,
			check: func(t *testing.T, got store.Quarantined) {
				if s, err := strconv.Unquote(got.AggregateType); err != nil || s != "a\x00b" {
					t.Errorf("aggregate_type %q does not unquote to the original: %v", got.AggregateType, err)
				}
				if got.Payload != `{"ok": 1}` {
					t.Errorf("payload %q changed, though jsonb takes it", got.Payload)
				}
				if !strings.Contains(got.ErrorMessage, `invalid topic name "outbox.event.a\x00b"`) {
					t.Errorf("error_message %q lost the relay's reason", got.ErrorMessage)
				}
			}},
		{name: "invalid UTF-8 in aggregate_id, no content given", e: store.Quarantined{
			Stored: event.Stored{EventID: harness.NewUUID(), AggregateType: "order", AggregateID: "\xff\xfe", EventType: "created", Payload: `{}`}},
			changed: []string{"aggregate_id (Go-quoted)"}},
		{name: "U+0000 in headers", e: store.Quarantined{
			Stored: func() event.Stored { s := valid("order", `{}`); s.Headers = `{"h": "\u0000"}`; return s }()},
			changed: []string{"headers (left out)"},
			check: func(t *testing.T, got store.Quarantined) {
				if got.Headers != "" {
					t.Errorf("headers %q", got.Headers)
				}
			}},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.e.ErrorClass = "permanent"
			if c.e.Topic == "" {
				c.e.Topic = "t"
			}
			if err := q.Put(ctx, c.e); err != nil {
				t.Fatalf("Put: %v", err)
			}
			if err := q.Put(ctx, c.e); err != nil {
				t.Fatalf("Put again (a re-stream): %v", err)
			}
			got, err := q.List(ctx, store.Selection{EventID: c.e.EventID})
			if err != nil || len(got) != 1 {
				t.Fatalf("List: %+v, %v", got, err)
			}
			g := got[0]
			if g.Attempts != 2 {
				t.Errorf("attempts %d, want 2", g.Attempts)
			}
			for _, want := range c.changed {
				if !strings.Contains(g.ContentProblem, want) || !strings.Contains(g.ErrorMessage, strings.TrimPrefix(want, "message content ")) && !strings.Contains(c.e.ContentProblem, want) {
					t.Errorf("content_problem %q / error_message %q: want both to say %q", g.ContentProblem, g.ErrorMessage, want)
				}
			}
			raw := c.raw
			if raw == "" {
				b, _ := json.Marshal(c.e.Stored)
				raw = string(b)
			}
			if string(g.Raw) != raw {
				t.Errorf("raw %q, want %q", g.Raw, raw)
			}
			sum := sha256.Sum256([]byte(raw))
			if g.RawSize != int64(len(raw)) || !bytes.Equal(g.RawSHA256, sum[:]) {
				t.Errorf("raw_size %d, raw_sha256 %x; want %d, %x", g.RawSize, g.RawSHA256, len(raw), sum)
			}
			if c.check != nil {
				c.check(t, g)
			}
			out, err := json.Marshal(g)
			if err != nil || !strings.Contains(string(out), `"raw_sha256":"`+hex.EncodeToString(sum[:])+`"`) ||
				!strings.Contains(string(out), `"raw":"`+base64.StdEncoding.EncodeToString([]byte(raw))+`"`) {
				t.Errorf("JSON %s, %v: want raw base64 and raw_sha256 hex", out, err)
			}
		})
	}

	// Kept by reference: a content never held in memory.
	sum := sha256.Sum256([]byte("never read"))
	ref := store.Quarantined{Stored: event.Stored{EventID: harness.NewUUID()}, RawSize: 500 << 20, RawSHA256: sum[:], RawLSN: 0xABCDEF,
		Topic: "(not resolved)", ErrorClass: "permanent", ErrorMessage: "message over --max-message-bytes"}
	if err := q.Put(ctx, ref); err != nil {
		t.Fatalf("Put by reference: %v", err)
	}
	got, err := q.List(ctx, store.Selection{EventID: ref.EventID})
	if err != nil || len(got) != 1 {
		t.Fatalf("List: %+v, %v", got, err)
	}
	g := got[0]
	if g.Raw != nil || g.RawSize != 500<<20 || !bytes.Equal(g.RawSHA256, sum[:]) || g.RawLSN != 0xABCDEF || !g.PayloadNull ||
		!strings.Contains(g.ContentProblem, "too large to keep") || !strings.Contains(g.ContentProblem, "0/ABCDEF") {
		t.Errorf("kept by reference: %+v", g)
	}
}

// Issue 40.2: a quarantine write that failed for any reason blamed the
// role's privileges. The advice follows the SQLSTATE.
func TestWriteAdviceFollowsTheSQLState(t *testing.T) {
	db := migrated(t)
	ctx := context.Background()
	conn := db.Connect(t)
	for _, c := range []struct{ sql, want, not string }{
		{"SELECT 'a\\u0000b'::jsonb", "bug of the relay", "grant"},
		{"INSERT INTO outbox_quarantine (no_such_column) VALUES (1)", "migrate --print-sql", "grant"},
		{"SET ROLE quarantine_nobody; INSERT INTO outbox_quarantine (event_id) VALUES (gen_random_uuid())", "grant", "migrate"},
	} {
		db.Exec(t, "DO $$ BEGIN CREATE ROLE quarantine_nobody; EXCEPTION WHEN duplicate_object THEN END $$")
		_, err := conn.Exec(ctx, c.sql)
		conn.Exec(ctx, "RESET ROLE")
		if err == nil {
			t.Fatalf("%s: no error", c.sql)
		}
		if advice := store.WriteAdvice(err); !strings.Contains(advice, c.want) || strings.Contains(advice, c.not) {
			t.Errorf("%s (%v): advice %q, want %q and not %q", c.sql, err, advice, c.want, c.not)
		}
	}
}

// A relay started against a quarantine table from before raw and
// content_problem refuses, naming migrate: it could not keep a content
// PostgreSQL refuses as text. list and replay take such a table.
func TestOpenQuarantineWantsTheRawColumns(t *testing.T) {
	db := migrated(t)
	db.Exec(t, "ALTER TABLE outbox_quarantine DROP COLUMN raw, DROP COLUMN raw_size, DROP COLUMN raw_sha256, DROP COLUMN raw_lsn, DROP COLUMN content_problem")
	cfg := pg.Config{DSN: db.DSN(), Table: "public.outbox_events"}
	table := store.Table{Schema: "public", Name: store.DefaultQuarantineName}
	ctx := context.Background()
	if _, err := store.OpenQuarantine(ctx, cfg, table, store.ForRelay); !errors.Is(err, pg.ErrPrecondition) || !strings.Contains(err.Error(), "run `outbox-relay migrate`") {
		t.Fatalf("relay against a table without raw: %v", err)
	}
	db.Exec(t, `INSERT INTO outbox_quarantine (event_id, aggregate_type, aggregate_id, event_type, payload, topic, error_class, error_message)
		VALUES (gen_random_uuid(), 'a', '1', 'e', '{}', 't', 'permanent', 'too large')`)
	for _, access := range []store.Access{store.ForList, store.ForReplay} {
		q, err := store.OpenQuarantine(ctx, cfg, table, access)
		if err != nil {
			t.Fatalf("access %d: %v", access, err)
		}
		got, err := q.List(ctx, store.Selection{})
		q.Close()
		if err != nil || len(got) != 1 || got[0].ContentProblem != "" {
			t.Errorf("access %d: List %+v, %v", access, got, err)
		}
	}
}

// Issue 40.2: a payload over jsonb's 256 MB limit (SQLSTATE 54000, "string
// too long to represent as jsonb string") failed the quarantine write. Put
// leaves the payload out and keeps it in raw. Full size only
// (OUTBOX_RELAY_DRILL_SIZE=full): it moves about a GB through PostgreSQL.
func TestPutStoresAPayloadOverJSONBsLimit(t *testing.T) {
	db, e := putHugePayload(t, 300_000_000)
	ctx := context.Background()
	payload := e.Payload
	var size int64
	var problem string
	var payloadNull bool
	if err := db.Connect(t).QueryRow(ctx, "SELECT length(raw), content_problem, payload IS NULL FROM outbox_quarantine WHERE event_id = $1", e.EventID).
		Scan(&size, &problem, &payloadNull); err != nil {
		t.Fatal(err)
	}
	if size != int64(len(payload)) || !payloadNull || !strings.Contains(problem, "54000") || !strings.Contains(problem, "payload (left out") {
		t.Errorf("raw of %d bytes, payload NULL %v, content_problem %q", size, payloadNull, problem)
	}
}

// A content over what a statement can carry (raw's 512 MB bound) is kept
// by reference: raw_size and raw_sha256, with raw NULL and the reason in
// content_problem, and the payload left out, rather than a write that
// fails on every attempt. Full size only: it holds 600 MB several times.
func TestPutKeepsAContentOverRawsBoundByReference(t *testing.T) {
	db, e := putHugePayload(t, 600_000_000)
	ctx := context.Background()
	payload := e.Payload
	sum := sha256.Sum256([]byte(payload))
	var rawNull, payloadNull bool
	var size int64
	var digest []byte
	var problem string
	if err := db.Connect(t).QueryRow(ctx, "SELECT raw IS NULL, raw_size, raw_sha256, payload IS NULL, content_problem FROM outbox_quarantine WHERE event_id = $1", e.EventID).
		Scan(&rawNull, &size, &digest, &payloadNull, &problem); err != nil {
		t.Fatal(err)
	}
	if !rawNull || size != int64(len(payload)) || !bytes.Equal(digest, sum[:]) || !payloadNull || !strings.Contains(problem, "too large to keep") {
		t.Errorf("raw NULL %v, raw_size %d, raw_sha256 %x, payload NULL %v, content_problem %q; want a reference to %d bytes with digest %x",
			rawNull, size, digest, payloadNull, problem, len(payload), sum)
	}
}

// putHugePayload quarantines an event whose payload, kept in raw too, is a
// JSON object of about n bytes, and returns it with its database. Full size
// only (OUTBOX_RELAY_DRILL_SIZE=full): it moves gigabytes through
// PostgreSQL.
func putHugePayload(t *testing.T, n int) (*harness.PGDatabase, store.Quarantined) {
	t.Helper()
	if harness.Sized(0, 1) == 0 {
		t.Skip("full size only: set " + harness.DrillSizeEnv + "=full")
	}
	db := migrated(t)
	payload := `{"s":"` + strings.Repeat("x", n) + `"}`
	e := store.Quarantined{Stored: event.Stored{EventID: harness.NewUUID(), AggregateType: "order", AggregateID: "1", EventType: "created", Payload: payload},
		Raw: []byte(payload), Topic: "t", ErrorClass: "permanent", ErrorMessage: "record too large"}
	if err := openForRelay(t, db).Put(context.Background(), e); err != nil {
		t.Fatalf("Put: %v", err)
	}
	return db, e
}
