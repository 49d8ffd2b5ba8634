package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/messages"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// raw are bytes no JSON or text column could hold.
var raw = []byte{0x0a, 0x00, 0x80, 0xff, '\\', 'x'}

func rawEvent(agg string) outbox.Event {
	return outbox.Event{AggregateType: "account", AggregateID: agg, EventType: "Credited", Payload: raw,
		ContentType: "application/x-protobuf"}
}

// With a content type the writer takes raw bytes, unchecked, into a bytea
// payload column, with both database APIs, and stores the type as the
// row's content-type header; without one JSON stays checked.
func TestWriterTakesRawBytesWithAContentType(t *testing.T) {
	ctx := context.Background()
	db := migratedDB(t)
	db.Exec(t, "ALTER TABLE outbox_events ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8')")
	w, err := outbox.New("")
	if err != nil {
		t.Fatal(err)
	}
	conn := db.Connect(t)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	bare := rawEvent("a-2")
	bare.ContentType, bare.RawPayload = "", true
	if _, err := w.Write(ctx, tx, rawEvent("a-1"), bare); err != nil {
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
	if _, err := w.WriteSQL(ctx, stx, rawEvent("a-3")); err != nil {
		t.Fatal(err)
	}
	if err := stx.Commit(); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, "SELECT aggregate_id, payload, headers->>'content-type' FROM outbox_events ORDER BY aggregate_id")
	if err != nil {
		t.Fatal(err)
	}
	for want := range strings.SplitSeq("a-1 a-2 a-3", " ") {
		var agg string
		var payload []byte
		var contentType *string
		if !rows.Next() {
			t.Fatalf("no row %s", want)
		}
		if err := rows.Scan(&agg, &payload, &contentType); err != nil {
			t.Fatal(err)
		}
		wantType := "application/x-protobuf"
		if agg == "a-2" {
			wantType = ""
		}
		if agg != want || !bytes.Equal(payload, raw) || (contentType == nil) != (wantType == "") || contentType != nil && *contentType != wantType {
			t.Errorf("row %s: payload %x, content-type %v", agg, payload, contentType)
		}
	}
	rows.Close()

	for _, c := range []struct {
		ev   outbox.Event
		want string
	}{
		{outbox.Event{AggregateType: "a", AggregateID: "b", EventType: "c", Payload: raw}, "Payload is not a JSON document"},
		{func() outbox.Event {
			ev := rawEvent("a-4")
			ev.Headers = map[string]string{"content-type": "text/plain"}
			return ev
		}(), "both ContentType and Headers set content-type"},
	} {
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(ctx, tx, c.ev); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", c.ev, err, c.want)
		}
		tx.Rollback(ctx)
	}
}

// An Emitter carries raw bytes base64 in payload_base64, which the
// messages source decodes to the same bytes, JSON events beside them
// unchanged.
func TestEmitterCarriesRawBytesAsBase64(t *testing.T) {
	ctx := context.Background()
	db := slotDB(t, "emit_raw_test")
	conn := db.Connect(t)
	e, err := outbox.NewEmitter("")
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Emit(ctx, tx, rawEvent("a-1"), event("a-2", 2)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	msgs := emitted(t, db.Connect(t), "emit_raw_test")
	if len(msgs) != 2 {
		t.Fatalf("%d messages, want 2: %q", len(msgs), msgs)
	}
	var d messages.Decoder
	for i, m := range msgs {
		content := m[strings.Index(m, " content:")+len(" content:"):]
		var v messages.Values
		if problem := d.Decode([]byte(content), 1, time.Now(), &v); problem != "" {
			t.Fatalf("message %d: %s: %s", i, problem, content)
		}
		switch {
		case i == 0 && (!d.PayloadBinary() || string(v[layout.Payload]) != `\x0a0080ff5c78` || string(v[layout.Headers]) != `{"content-type": "application/x-protobuf"}`):
			t.Errorf("raw message: binary %v, payload %s, headers %s", d.PayloadBinary(), v[layout.Payload], v[layout.Headers])
		case i == 1 && (d.PayloadBinary() || string(v[layout.Payload]) != `{"n": 2}`):
			t.Errorf("JSON message: binary %v, payload %s", d.PayloadBinary(), v[layout.Payload])
		}
	}
}
