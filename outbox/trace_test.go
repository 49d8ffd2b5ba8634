package outbox_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/outbox"
)

// spanContext is a caller's span as the OpenTelemetry API puts it in a
// context, with a tracestate, so the test needs no SDK.
func spanContext(t *testing.T) (context.Context, trace.SpanContext) {
	t.Helper()
	ts, err := trace.ParseTraceState("vendor=abc,other=1")
	if err != nil {
		t.Fatal(err)
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: trace.FlagsSampled,
		TraceState: ts,
	})
	return trace.ContextWithSpanContext(context.Background(), sc), sc
}

const wantTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// storedHeaders reads the headers column of the given events, by ID.
func storedHeaders(t *testing.T, conn *pgx.Conn, ids []string) []map[string]string {
	t.Helper()
	out := make([]map[string]string, len(ids))
	for i, id := range ids {
		var raw []byte
		if err := conn.QueryRow(context.Background(), `SELECT headers FROM outbox_events WHERE event_id = $1`, id).Scan(&raw); err != nil {
			t.Fatal(err)
		}
		if raw != nil {
			if err := json.Unmarshal(raw, &out[i]); err != nil {
				t.Fatal(err)
			}
		}
	}
	return out
}

// Write and WriteSQL store the caller's span context as W3C headers; an
// event that sets traceparent itself keeps its own, and a context without
// a span adds nothing.
func TestWriterStoresTheCallersTraceContext(t *testing.T) {
	db := migratedDB(t)
	conn := db.Connect(t)
	w := newWriter(t)
	ctx, _ := spanContext(t)

	own := event("a", 2)
	own.Headers = map[string]string{"traceparent": "00-11111111111111111111111111111111-2222222222222222-00"}
	ownState := event("a", 3)
	ownState.Headers = map[string]string{"tracestate": "mine=1"}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := w.Write(ctx, tx, event("a", 1), own, ownState)
	if err != nil {
		t.Fatal(err)
	}
	plain, err := w.Write(context.Background(), tx, event("a", 4))
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	sqlDB, err := sql.Open("pgx", db.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer sqlDB.Close()
	stx, err := sqlDB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	viaSQL, err := w.WriteSQL(ctx, stx, event("b", 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := stx.Commit(); err != nil {
		t.Fatal(err)
	}

	got := storedHeaders(t, conn, append(append(ids, plain...), viaSQL...))
	for i, want := range []map[string]string{
		{"traceparent": wantTraceparent, "tracestate": "vendor=abc,other=1"},
		{"traceparent": "00-11111111111111111111111111111111-2222222222222222-00"},
		{"traceparent": wantTraceparent, "tracestate": "mine=1"},
		nil,
		{"traceparent": wantTraceparent, "tracestate": "vendor=abc,other=1"},
	} {
		if len(got[i]) != len(want) {
			t.Errorf("event %d: headers %v, want %v", i+1, got[i], want)
			continue
		}
		for k, v := range want {
			if got[i][k] != v {
				t.Errorf("event %d: header %s = %q, want %q", i+1, k, got[i][k], v)
			}
		}
	}
}

// Emit carries the caller's span context in the message's headers, as
// Write does in the row's.
func TestEmitterStoresTheCallersTraceContext(t *testing.T) {
	db := slotDB(t, "emit_trace_test")
	conn := db.Connect(t)
	e, err := outbox.NewEmitter("")
	if err != nil {
		t.Fatal(err)
	}
	ctx, _ := spanContext(t)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Emit(ctx, tx, event("a", 1)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	msgs := emitted(t, conn, "emit_trace_test")
	if len(msgs) != 1 {
		t.Fatalf("%d messages, want 1: %q", len(msgs), msgs)
	}
	for _, want := range []string{`"traceparent": "` + wantTraceparent + `"`, `"tracestate": "vendor=abc,other=1"`} {
		if !strings.Contains(msgs[0], want) {
			t.Errorf("message %s lacks %s", msgs[0], want)
		}
	}
}
