package inbox_test

import (
	"bytes"
	"context"
	"maps"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// A parked event comes back to the handler as it arrived, byte for byte:
// a structured CloudEvent whose data is null (a nil payload), a header
// holding a NUL byte and one holding bytes that are not UTF-8. jsonb
// refused the first two for ever and turned the third into U+FFFD U+FFFD.
func TestParkedEventComesBackByteForByte(t *testing.T) {
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{CheckVersions: true})
	ctx := context.Background()

	nullData, err := inbox.ParseRecord(nil, []inbox.Header{
		{Key: []byte("content-type"), Value: []byte("application/cloudevents+json")},
		{Key: []byte("aggregate_version"), Value: []byte("3")},
		{Key: []byte("nul"), Value: []byte("a\x00b")},
		{Key: []byte("raw"), Value: []byte("\xff\xfe")},
		{Key: []byte("key\x00\xff"), Value: []byte("")},
	}, []byte(`{"specversion":"1.0","id":"n3","source":"/t","type":"Credited","subject":"a","data":null}`))
	if err != nil {
		t.Fatal(err)
	}
	if nullData.Payload != nil {
		t.Fatalf("ParseRecord gave payload %q for data null, want nil", nullData.Payload)
	}
	empty := inbox.Event{ID: "n4", AggregateID: "a", EventType: "Credited", Version: 4,
		Payload: []byte{}, Headers: map[string]string{"raw": "\xff\xfe\x00"}}
	binary := inbox.Event{ID: "n5", AggregateID: "a", EventType: "Credited", Version: 5,
		Payload: []byte("\x00\xff\xfe\x80"), Headers: map[string]string{}}
	sent := []inbox.Event{nullData, empty, binary}

	received := map[string]inbox.Event{}
	capture := func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
		received[ev.ID] = ev
		return recordEffect(ctx, tx, ev)
	}
	first := inbox.Event{ID: "n1", AggregateID: "a", EventType: "Credited", Version: 1, Payload: []byte(`{}`), Headers: map[string]string{}}
	if r, err := ib.Handle(ctx, conn, first, capture); err != nil || r.Outcome != inbox.Applied {
		t.Fatalf("version 1: %+v, %v", r, err)
	}
	for _, e := range sent {
		r, err := ib.Handle(ctx, conn, e, capture)
		if err != nil {
			t.Fatalf("park %s: %v", e.ID, err)
		}
		if r.Outcome != inbox.Parked {
			t.Fatalf("%s (version %d after 1): %v, want parked", e.ID, e.Version, r.Outcome)
		}
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_parked`); n != int64(len(sent)) {
		t.Fatalf("%d events parked, want %d", n, len(sent))
	}
	second := inbox.Event{ID: "n2", AggregateID: "a", EventType: "Credited", Version: 2, Payload: []byte(`{}`), Headers: map[string]string{}}
	if r, err := ib.Handle(ctx, conn, second, capture); err != nil || r.Outcome != inbox.Applied || r.Released != len(sent) {
		t.Fatalf("version 2: %+v, %v; want applied with %d released", r, err, len(sent))
	}
	if got := effects(t, db); got != "n1,n2,n3,n4,n5" {
		t.Fatalf("effects %q, want n1..n5 in order", got)
	}
	for _, want := range sent {
		got := received[want.ID]
		if (got.Payload == nil) != (want.Payload == nil) || !bytes.Equal(got.Payload, want.Payload) {
			t.Errorf("%s: handler got payload %q (nil %t), sent %q (nil %t)", want.ID, got.Payload, got.Payload == nil, want.Payload, want.Payload == nil)
		}
		if !maps.Equal(got.Headers, want.Headers) {
			t.Errorf("%s: handler got headers %q, sent %q", want.ID, got.Headers, want.Headers)
		}
	}
}

// A deployment whose parked table an older version created (headers as
// jsonb, payload NOT NULL) is upgraded in place by applying SQL again: its
// parked events keep their headers and are released as before, and new
// ones park byte for byte. Applying SQL once more changes nothing.
func TestSQLUpgradesAnOlderParkedTable(t *testing.T) {
	db := pg.CreateTestDatabase(t)
	db.Exec(t, olderParkedTable)
	db.Exec(t, `INSERT INTO inbox_parked VALUES ('billing', 'account', 'a', 3, 'o3', 'Credited', '\x7b7d',
		'{"event_id": "o3", "note": "caf\u00e9"}', now())`)
	ddl, err := inbox.SQL(inbox.Tables{})
	if err != nil {
		t.Fatal(err)
	}
	db.Exec(t, ddl)
	db.Exec(t, ddl)
	db.Exec(t, `CREATE TABLE effects (seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text, version bigint)`)
	if n := db.QueryInt64(t, `SELECT count(*) FROM pg_attribute WHERE attrelid = 'inbox_parked'::regclass
		AND attname = 'headers' AND NOT attisdropped`); n != 0 {
		t.Fatalf("the jsonb headers column is still there")
	}

	conn := db.Connect(t)
	ctx := context.Background()
	ib := newInbox(t, inbox.Config{CheckVersions: true})
	received := map[string]inbox.Event{}
	capture := func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
		received[ev.ID] = ev
		return recordEffect(ctx, tx, ev)
	}
	nul := inbox.Event{ID: "o4", AggregateType: "account", AggregateID: "a", EventType: "Credited", Version: 4,
		Headers: map[string]string{"nul": "\x00", "raw": "\xff\xfe"}}
	for _, e := range []inbox.Event{
		{ID: "o1", AggregateType: "account", AggregateID: "a", EventType: "Credited", Version: 1, Payload: []byte(`{}`)},
		nul,
		{ID: "o2", AggregateType: "account", AggregateID: "a", EventType: "Credited", Version: 2, Payload: []byte(`{}`)},
	} {
		if _, err := ib.Handle(ctx, conn, e, capture); err != nil {
			t.Fatalf("%s: %v", e.ID, err)
		}
	}
	if got := effects(t, db); got != "o1,o2,o3,o4" {
		t.Fatalf("effects %q, want o1..o4 in order", got)
	}
	if got := received["o3"]; !maps.Equal(got.Headers, map[string]string{"event_id": "o3", "note": "café"}) || string(got.Payload) != `{}` {
		t.Errorf("the event parked before the upgrade came back as %q, %q", got.Payload, got.Headers)
	}
	if got := received["o4"]; !maps.Equal(got.Headers, nul.Headers) || got.Payload != nil {
		t.Errorf("the event parked after the upgrade came back as %q, %q; sent nil, %q", got.Payload, got.Headers, nul.Headers)
	}
}

// olderParkedTable is the parked table as inbox.SQL created it before its
// headers became bytea.
const olderParkedTable = `CREATE TABLE inbox_parked (
    consumer       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    version        bigint      NOT NULL,
    event_id       text        NOT NULL,
    event_type     text        NOT NULL,
    payload        bytea       NOT NULL,
    headers        jsonb       NOT NULL,
    parked_at      timestamptz NOT NULL,
    PRIMARY KEY (consumer, aggregate_type, aggregate_id, version)
)`
