package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver

	relayevent "github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

func newWriter(t *testing.T) *outbox.Writer {
	t.Helper()
	w, err := outbox.New("")
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func event(agg string, n int) outbox.Event {
	return outbox.Event{AggregateType: "account", AggregateID: agg, EventType: "Credited",
		Payload: fmt.Appendf(nil, `{"n": %d}`, n)}
}

// The point of the outbox: an event exists exactly when its business change
// does. Both commit together, and a rollback removes both.
func TestWriterEventAndBusinessRowShareTheTransaction(t *testing.T) {
	ctx := context.Background()
	db := migratedDB(t)
	conn := db.Connect(t)
	db.Exec(t, `CREATE TABLE accounts (id text PRIMARY KEY, balance int NOT NULL)`)
	w := newWriter(t)

	write := func(id string, commit bool) []string {
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO accounts VALUES ($1, 10)`, id); err != nil {
			t.Fatal(err)
		}
		ids, err := w.Write(ctx, tx, event(id, 1), event(id, 2))
		if err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		return ids
	}
	kept := write("kept", true)
	undone := write("undone", false)

	if n := db.QueryInt64(t, `SELECT count(*) FROM accounts WHERE id = 'kept'`); n != 1 {
		t.Errorf("committed business row: %d rows", n)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM outbox_events WHERE event_id = ANY($1::uuid[])`, kept); n != 2 {
		t.Errorf("committed transaction: %d of 2 events in the outbox", n)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM accounts WHERE id = 'undone'`); n != 0 {
		t.Errorf("rolled-back business row is there")
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM outbox_events WHERE event_id = ANY($1::uuid[])`, undone); n != 0 {
		t.Errorf("rolled-back transaction left %d events in the outbox", n)
	}
}

// Each event the relay would refuse or quarantine is refused by the writer,
// and a batch with one bad event writes nothing.
func TestWriterRefusesWhatTheRelayWouldNot(t *testing.T) {
	ctx := context.Background()
	db := migratedDB(t)
	conn := db.Connect(t)
	w := newWriter(t)
	good := event("a", 1)
	for _, c := range []struct {
		name string
		edit func(*outbox.Event)
		want string
	}{
		{"empty aggregate id", func(e *outbox.Event) { e.AggregateID = "" }, "AggregateID is empty"},
		{"empty aggregate type", func(e *outbox.Event) { e.AggregateType = "" }, "AggregateType is empty"},
		{"empty event type", func(e *outbox.Event) { e.EventType = "" }, "EventType is empty"},
		{"payload not JSON", func(e *outbox.Event) { e.Payload = []byte("{") }, "Payload is not a JSON document"},
		{"no payload", func(e *outbox.Event) { e.Payload = nil }, "Payload is not a JSON document"},
		// Valid JSON that jsonb refuses (SQLSTATE 22P05): inside PostgreSQL
		// it would abort the caller's transaction and its business change.
		{"NUL escape in the payload", func(e *outbox.Event) { e.Payload = []byte(`{"note":"a\u0000b"}`) }, `Payload holds the escape \u0000`},
		{"NUL escape in a payload key", func(e *outbox.Event) { e.Payload = []byte(`{"a\u0000":1}`) }, `Payload holds the escape \u0000`},
		{"reserved header", func(e *outbox.Event) { e.Headers = map[string]string{"aggregate_id": "x"} }, `header "aggregate_id" is set by the relay`},
		{"version header by hand", func(e *outbox.Event) { e.Headers = map[string]string{"aggregate_version": "3"} }, "set that instead"},
		{"id not a uuid", func(e *outbox.Event) { e.ID = "order-1" }, "is not a UUID"},
		{"NUL in a header", func(e *outbox.Event) { e.Headers = map[string]string{"k": "a\x00b"} }, "NUL byte"},
		{"negative version", func(e *outbox.Event) { e.AggregateVersion = -1 }, "negative"},
	} {
		t.Run(c.name, func(t *testing.T) {
			bad := event("a", 2)
			c.edit(&bad)
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			_, err = w.Write(ctx, tx, good, bad)
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "event 2 of 2") {
				t.Fatalf("got %v, want an error for event 2 of 2 containing %q", err, c.want)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if n := db.QueryInt64(t, `SELECT count(*) FROM outbox_events`); n != 0 {
				t.Fatalf("%d events written from a batch with a bad one", n)
			}
		})
	}
}

// The \u0000 check reads escapes, not bytes: an escaped backslash followed
// by "u0000" is ordinary text that jsonb stores.
func TestWriterKeepsAnEscapedBackslashBeforeU0000(t *testing.T) {
	ctx := context.Background()
	db := migratedDB(t)
	conn := db.Connect(t)
	ev := event("a", 1)
	ev.Payload = []byte(`{"path":"C:\\u0000"}`)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := newWriter(t).Write(ctx, tx, ev); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := db.QueryString(t, `SELECT payload->>'path' FROM outbox_events`); got != `C:\u0000` {
		t.Fatalf("stored path %q, want %q", got, `C:\u0000`)
	}
}

// A batch goes in one statement per 1,000 events, in order, and each row is
// what the relay publishes: the caller's ID kept, others UUIDv7 in time
// order, headers and the aggregate version as Kafka headers.
func TestWriterBatchRowsAsTheRelayReadsThem(t *testing.T) {
	ctx := context.Background()
	db := migratedDB(t)
	cfg, err := pgx.ParseConfig(db.DSN())
	if err != nil {
		t.Fatal(err)
	}
	counter := &harness.StatementCounter{}
	cfg.Tracer = counter
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	w := newWriter(t)

	const n = 2500
	events := make([]outbox.Event, n)
	for i := range events {
		events[i] = event(fmt.Sprintf("agg-%d", i%10), i)
		events[i].AggregateVersion = int64(i/10 + 1)
		if i%2 == 0 {
			events[i].Headers = map[string]string{"tenant": "acme"}
		}
	}
	events[7].ID = "0190F3A4-1C2B-7D3E-8F40-5A6B7C8D9E0F"
	occurred := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	events[8].OccurredAt = occurred
	events[9].SchemaVersion = 3

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	before := counter.Count()
	ids, err := w.Write(ctx, tx, events...)
	if err != nil {
		t.Fatal(err)
	}
	if got := counter.Count() - before; got != 3 {
		t.Errorf("%d events took %d statements, want 3 (one per 1,000)", n, got)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if ids[7] != "0190f3a4-1c2b-7d3e-8f40-5a6b7c8d9e0f" {
		t.Errorf("caller's ID came back as %s, want it kept (in PostgreSQL's lower case)", ids[7])
	}
	if ids[0] >= ids[1] && ids[0][:8] != ids[1][:8] {
		t.Errorf("generated IDs %s, %s are not time-ordered", ids[0], ids[1])
	}
	if ids[0][14] != '7' {
		t.Errorf("generated ID %s is not a version 7 UUID", ids[0])
	}

	rows, err := conn.Query(ctx, `SELECT event_id::text, aggregate_type, aggregate_id, event_type, schema_version::text,
		payload::text, headers::text, to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US') || '+00'
		FROM outbox_events ORDER BY created_at, event_id`)
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]*publisher.Record{}
	for rows.Next() {
		var f [8]*string
		if err := rows.Scan(&f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6], &f[7]); err != nil {
			t.Fatal(err)
		}
		b := func(s *string) []byte {
			if s == nil {
				return nil
			}
			return []byte(*s)
		}
		ev := &relayevent.Event{EventID: b(f[0]), AggregateType: b(f[1]), AggregateID: b(f[2]), EventType: b(f[3]),
			SchemaVersion: b(f[4]), Payload: b(f[5]), Headers: b(f[6]), OccurredAt: b(f[7])}
		if perr := sink.CheckRow(ev); perr != nil {
			t.Fatalf("the relay refuses row %s: %v", *f[0], perr)
		}
		rec, err := publisher.BuildRecord(ev, "t")
		if err != nil {
			t.Fatalf("the relay cannot build row %s: %v", *f[0], err)
		}
		byID[rec.EventID()] = rec
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(byID) != n {
		t.Fatalf("%d rows, want %d", len(byID), n)
	}
	for i, id := range ids {
		rec := byID[id]
		if rec == nil {
			t.Fatalf("event %d (%s) missing", i, id)
		}
		if got, want := string(rec.Header("aggregate_version")), fmt.Sprint(events[i].AggregateVersion); got != want {
			t.Errorf("event %d: aggregate_version header %q, want %q", i, got, want)
		}
		if got, want := string(rec.Header("tenant")), events[i].Headers["tenant"]; got != want {
			t.Errorf("event %d: tenant header %q, want %q", i, got, want)
		}
		if string(rec.Key()) != events[i].AggregateID {
			t.Errorf("event %d: key %q", i, rec.Key())
		}
	}
	if got := string(byID[ids[8]].Header("occurred_at")); got != "2026-11-30T12:00:00.000000Z" {
		t.Errorf("occurred_at header %q, want the event's own time", got)
	}
	if got := string(byID[ids[9]].Header("schema_version")); got != "3" {
		t.Errorf("schema_version header %q, want 3", got)
	}

	// A retry of the same request, with the same ID, is refused by the
	// primary key rather than written twice.
	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := w.Write(ctx, tx, events[7]); err == nil || !strings.Contains(err.Error(), "duplicate key") {
		t.Errorf("rewriting event ID %s: got %v, want a unique violation", ids[7], err)
	}
}

// database/sql transactions work the same way.
func TestWriterDatabaseSQL(t *testing.T) {
	ctx := context.Background()
	db := migratedDB(t)
	sqlDB, err := sql.Open("pgx", db.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer sqlDB.Close()
	w := newWriter(t)
	for _, commit := range []bool{true, false} {
		tx, err := sqlDB.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		e := event("sql", 1)
		e.Headers = map[string]string{"tenant": "acme"}
		e.OccurredAt = time.Now()
		ids, err := w.WriteSQL(ctx, tx, e, event("sql", 2))
		if err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit()
		} else {
			err = tx.Rollback()
		}
		if err != nil {
			t.Fatal(err)
		}
		want := map[bool]int64{true: 2, false: 0}[commit]
		if n := db.QueryInt64(t, `SELECT count(*) FROM outbox_events WHERE event_id = ANY($1::uuid[])`, ids); n != want {
			t.Errorf("commit=%v: %d events, want %d", commit, n, want)
		}
	}
}
