package outbox_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/messages"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// emitted reads the messages a test_decoding slot saw since the last read:
// prefix and content of each, in WAL order.
func emitted(t *testing.T, conn *pgx.Conn, slot string) []string {
	t.Helper()
	rows, err := conn.Query(context.Background(), `SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL) WHERE data LIKE 'message:%'`, slot)
	if err != nil {
		t.Fatal(err)
	}
	data, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// Emit writes each event as a transactional message the relay's messages
// source decodes without a problem, in order, only if the transaction
// commits; it refuses what Write refuses, emitting nothing.
func TestEmitterEmitsWhatTheMessagesSourceReads(t *testing.T) {
	ctx := context.Background()
	db := slotDB(t, "emit_test")
	conn := db.Connect(t)
	e, err := outbox.NewEmitter("")
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 12, 2, 10, 0, 0, 250000000, time.UTC)
	first := event("a-1", 1)
	first.ID = "0B5A1D64-8B0E-4C7A-9C53-1D2E3F405162"
	first.Headers = map[string]string{"tenant": "acme"}
	first.AggregateVersion = 7
	first.OccurredAt = at
	second := event("a-2", 2)
	second.SchemaVersion = 2

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Emit(ctx, tx, event("rolled-back", 0)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := e.Emit(ctx, tx, first, second)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if ids[0] != strings.ToLower(first.ID) || len(ids[1]) != 36 {
		t.Fatalf("Emit returned %v", ids)
	}
	msgs := emitted(t, db.Connect(t), "emit_test")
	if len(msgs) != 2 {
		t.Fatalf("%d messages decoded, want the 2 committed ones: %q", len(msgs), msgs)
	}
	var d messages.Decoder
	for i, m := range msgs {
		if !strings.HasPrefix(m, "message: transactional: 1 prefix: outbox, sz: ") {
			t.Fatalf("message %d is not transactional with prefix outbox: %s", i, m)
		}
		content := m[strings.Index(m, " content:")+len(" content:"):]
		var v messages.Values
		if problem := d.Decode([]byte(content), 1, time.Now(), &v); problem != "" {
			t.Fatalf("message %d: %s: %s", i, problem, content)
		}
		if string(v[layout.EventID]) != ids[i] {
			t.Errorf("message %d carries event %s, want %s", i, v[layout.EventID], ids[i])
		}
		if i == 0 && (string(v[layout.Headers]) != `{"tenant": "acme", "aggregate_version": "7"}` || string(v[layout.OccurredAt]) != "2026-12-02 10:00:00.25+00" ||
			string(v[layout.Payload]) != `{"n": 1}`) {
			t.Errorf("first message decoded to headers %s, occurred_at %s, payload %s", v[layout.Headers], v[layout.OccurredAt], v[layout.Payload])
		}
		if i == 1 && (string(v[layout.SchemaVersion]) != "2" || v[layout.Headers] != nil) {
			t.Errorf("second message decoded to schema version %s, headers %s", v[layout.SchemaVersion], v[layout.Headers])
		}
	}

	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	bad := event("a-3", 3)
	bad.Payload = []byte("{not json")
	if _, err := e.Emit(ctx, tx, event("a-3", 1), bad); err == nil || !strings.Contains(err.Error(), "outbox event 2 of 2") {
		t.Fatalf("Emit of an invalid event: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if msgs := emitted(t, db.Connect(t), "emit_test"); len(msgs) != 0 {
		t.Errorf("a refused Emit emitted %q", msgs)
	}
}

// EmitSQL is Emit for database/sql.
func TestEmitterDatabaseSQL(t *testing.T) {
	ctx := context.Background()
	db := slotDB(t, "emit_sql_test")
	sqlDB, err := sql.Open("pgx", db.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer sqlDB.Close()
	e, err := outbox.NewEmitter("billing")
	if err != nil {
		t.Fatal(err)
	}
	tx, err := sqlDB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.EmitSQL(ctx, tx, event("s-1", 1), event("s-1", 2)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	msgs := emitted(t, db.Connect(t), "emit_sql_test")
	if len(msgs) != 2 || !strings.Contains(msgs[0], "prefix: billing,") || !strings.Contains(msgs[1], `"payload": {"n": 2}`) {
		t.Fatalf("messages %q", msgs)
	}
}
