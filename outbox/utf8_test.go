package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/outbox"
)

// The writer let through text PostgreSQL refuses, and the refusal aborted
// the service's transaction with its business change (issue 55, item 6):
// a JSON payload with bytes that are not UTF-8 (SQLSTATE 22021) or a lone
// surrogate escape such as {"a":"\ud800"} (22P02, which jsonb refuses
// though the JSON grammar allows it), and an AggregateID that is not UTF-8
// (22021). Header bytes that are not UTF-8 were stored as U+FFFD without a
// word (the headers column is jsonb). Each is now refused by Write, naming
// the event and the field, before anything is written, and the caller's
// transaction stays usable.
func TestWriterRefusesTextPostgreSQLCannotStore(t *testing.T) {
	ctx := context.Background()
	db := migratedDB(t)
	conn := db.Connect(t)
	w := newWriter(t)
	good := event("a", 1)
	good.ID = outbox.NewID()
	goodID := good.ID
	for _, c := range []struct {
		name string
		edit func(*outbox.Event)
		want string
	}{
		{"payload not UTF-8", func(e *outbox.Event) { e.Payload = []byte("{\"a\":\"\xff\"}") }, "Payload is not UTF-8 at byte 6"},
		{"lone high surrogate", func(e *outbox.Event) { e.Payload = []byte(`{"a":"\ud800"}`) }, `Payload holds the escape \ud800 at byte 6, a lone surrogate`},
		{"high surrogate then text", func(e *outbox.Event) { e.Payload = []byte(`{"a":"\uD83Dx"}`) }, `lone surrogate`},
		{"lone low surrogate", func(e *outbox.Event) { e.Payload = []byte(`{"a":"x\udc00"}`) }, `Payload holds the escape \udc00 at byte 7, a lone surrogate`},
		{"two high surrogates", func(e *outbox.Event) { e.Payload = []byte(`{"a":"\ud800\ud800"}`) }, `lone surrogate`},
		{"aggregate id not UTF-8", func(e *outbox.Event) { e.AggregateID = "a\xc3" }, "AggregateID is not UTF-8"},
		{"aggregate type not UTF-8", func(e *outbox.Event) { e.AggregateType = "\xfe" }, "AggregateType is not UTF-8"},
		{"event type not UTF-8", func(e *outbox.Event) { e.EventType = "\x80" }, "EventType is not UTF-8"},
		{"header value not UTF-8", func(e *outbox.Event) { e.Headers = map[string]string{"tenant": "ac\xffme"} }, `header "tenant" is not UTF-8`},
		{"header name not UTF-8", func(e *outbox.Event) { e.Headers = map[string]string{"t\xff": "acme"} }, `is not UTF-8`},
		{"content type not UTF-8", func(e *outbox.Event) { e.ContentType = "application/\xff" }, `ContentType: header "content-type" is not UTF-8`},
		// From a hostile try: each of these aborted the caller's
		// transaction at the insert, or was stored changed.
		{"number past numeric", func(e *outbox.Event) { e.Payload = []byte(`{"n": 1e300000}`) }, "past what PostgreSQL's numeric holds"},
		{"tiny number past numeric", func(e *outbox.Event) { e.Payload = []byte(`{"n": 1e-300000}`) }, "past what PostgreSQL's numeric holds"},
		{"member twice", func(e *outbox.Event) { e.Payload = []byte(`{"a":1,"a":2}`) }, `member "a" twice`},
		{"occurred far ahead", func(e *outbox.Event) { e.OccurredAt = time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC) }, "outside what PostgreSQL's timestamptz holds"},
		{"occurred far back", func(e *outbox.Event) { e.OccurredAt = time.Date(-5000, 1, 1, 0, 0, 0, 0, time.UTC) }, "outside what PostgreSQL's timestamptz holds"},
		{"schema version past int", func(e *outbox.Event) { e.SchemaVersion = 3_000_000_000 }, "past the column's int range"},
		{"the first event's ID again", func(e *outbox.Event) { e.ID = strings.ToUpper(goodID) }, "have one ID"},
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
				t.Fatalf("the caller's transaction is unusable after the refusal: %v", err)
			}
			if n := db.QueryInt64(t, `SELECT count(*) FROM outbox_events`); n != 0 {
				t.Fatalf("%d events written from a batch with a bad one", n)
			}
		})
	}
}

// A surrogate pair is one character and is kept; so is an escaped
// backslash before "ud800", which is text.
func TestWriterKeepsSurrogatePairs(t *testing.T) {
	ctx := context.Background()
	db := migratedDB(t)
	conn := db.Connect(t)
	ev := event("a", 1)
	ev.Payload = []byte(`{"smile":"\ud83d\ude00","path":"C:\\ud800"}`)
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
	if got := db.QueryString(t, `SELECT (payload->>'smile') || (payload->>'path') FROM outbox_events`); got != "\U0001F600"+`C:\ud800` {
		t.Fatalf("stored %q", got)
	}
}
