package inbox_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/layout"
)

// relayRecord builds the record the relay would publish for one event in
// the given record format, with the relay's own code for that format.
func relayRecord(t *testing.T, format, headerColumns string, payload []byte, binary bool, extra ...[]byte) event.Record {
	t.Helper()
	table := layout.NameRelay
	if format == layout.FormatNameDebezium {
		table = layout.NameDebezium
	}
	l, err := layout.New(table, [layout.NumColumns]string{}, headerColumns)
	if err != nil {
		t.Fatal(err)
	}
	source := ""
	if format == layout.FormatNameCloudEvents || format == layout.FormatNameCloudEventsStructured {
		source = "https://example.com/billing"
	}
	if err := l.SetRecordFormat(format, source); err != nil {
		t.Fatal(err)
	}
	ev := event.Event{EventID: []byte("0192f0c1-7a3b-7c4d-8e5f-000000000001"), AggregateType: []byte("order"),
		AggregateID: []byte("42"), EventType: []byte("OrderPlaced"), SchemaVersion: []byte("1"),
		Payload: payload, PayloadBinary: binary, Headers: []byte(`{"aggregate_version": "7", "tenant": "acme"}`),
		OccurredAt: []byte("2026-11-29 21:03:56.123456+00"), Extra: extra, Layout: l}
	var r event.Record
	if err := event.Build(&ev, &r); err != nil {
		t.Fatalf("build a %s record: %v", format, err)
	}
	return r
}

func parse(t *testing.T, r event.Record) inbox.Event {
	t.Helper()
	headers := make([]inbox.Header, len(r.Headers))
	for i, h := range r.Headers {
		headers[i] = inbox.Header{Key: h.Key, Value: h.Value}
	}
	ev, err := inbox.ParseRecord(r.Key, headers, r.Value)
	if err != nil {
		t.Fatalf("parse: %v", err)
	}
	return ev
}

// Every record format the relay writes gives the inbox the event id, the
// aggregate id, the version and the payload it was written with; the event
// type and aggregate type where the format carries them.
func TestParseRecordReadsEveryRecordFormat(t *testing.T) {
	const jsonPayload = `{"amount": 1250, "note": "a \"quoted\" word"}`
	for _, tc := range []struct {
		format, headerColumns       string
		aggregateType, eventType    string
		payload                     []byte
		binary                      bool
		wantPayload, wantContentTyp string
		extra                       [][]byte
	}{
		{format: layout.FormatNameRelay, aggregateType: "order", eventType: "OrderPlaced", payload: []byte(jsonPayload), wantPayload: jsonPayload},
		{format: layout.FormatNameCloudEvents, eventType: "OrderPlaced", payload: []byte(jsonPayload), wantPayload: jsonPayload, wantContentTyp: "application/json"},
		{format: layout.FormatNameCloudEventsStructured, eventType: "OrderPlaced", payload: []byte(jsonPayload), wantPayload: jsonPayload, wantContentTyp: "application/json"},
		{format: layout.FormatNameCloudEventsStructured, eventType: "OrderPlaced", payload: []byte("plain \"text\" ü"), wantPayload: "plain \"text\" ü", wantContentTyp: "text/plain; charset=utf-8"},
		{format: layout.FormatNameCloudEventsStructured, eventType: "OrderPlaced", payload: []byte(`\x00ff0a22`), binary: true, wantPayload: "\x00\xff\x0a\x22", wantContentTyp: "application/octet-stream"},
		{format: layout.FormatNameCloudEvents, eventType: "OrderPlaced", payload: []byte(`\x00ff0a22`), binary: true, wantPayload: "\x00\xff\x0a\x22", wantContentTyp: "application/octet-stream"},
		{format: layout.FormatNameDebezium, payload: []byte(jsonPayload), wantPayload: jsonPayload},
		{format: layout.FormatNameDebezium, headerColumns: "type:eventType", eventType: "OrderPlaced", payload: []byte(jsonPayload), wantPayload: jsonPayload, extra: [][]byte{[]byte("OrderPlaced")}},
	} {
		t.Run(tc.format+"/"+tc.wantContentTyp+tc.headerColumns, func(t *testing.T) {
			ev := parse(t, relayRecord(t, tc.format, tc.headerColumns, tc.payload, tc.binary, tc.extra...))
			if ev.ID != "0192f0c1-7a3b-7c4d-8e5f-000000000001" || ev.AggregateID != "42" || ev.Version != 7 {
				t.Errorf("id %q, aggregate id %q, version %d", ev.ID, ev.AggregateID, ev.Version)
			}
			if ev.AggregateType != tc.aggregateType || ev.EventType != tc.eventType {
				t.Errorf("aggregate type %q, event type %q; want %q, %q", ev.AggregateType, ev.EventType, tc.aggregateType, tc.eventType)
			}
			if !bytes.Equal(ev.Payload, []byte(tc.wantPayload)) {
				t.Errorf("payload %q, want %q", ev.Payload, tc.wantPayload)
			}
			if got := ev.Headers["content-type"]; got != tc.wantContentTyp {
				t.Errorf("content-type %q, want %q", got, tc.wantContentTyp)
			}
			if ev.Headers["tenant"] != "acme" {
				t.Errorf("the row's header tenant is %q", ev.Headers["tenant"])
			}
			if strings.HasPrefix(tc.format, "cloudevents") &&
				(ev.Headers["ce_time"] != "2026-11-29T21:03:56.123456Z" || ev.Headers["ce_source"] != "https://example.com/billing" || ev.Headers["ce_id"] != ev.ID) {
				t.Errorf("a CloudEvent's attributes as headers: ce_time %q, ce_source %q, ce_id %q", ev.Headers["ce_time"], ev.Headers["ce_source"], ev.Headers["ce_id"])
			}
		})
	}
}

// A record of no format the relay writes, and a structured CloudEvent
// without an id, cannot be deduplicated and are refused.
func TestParseRecordRefusesRecordsWithoutAnEventID(t *testing.T) {
	for name, rec := range map[string]struct {
		headers []inbox.Header
		value   string
	}{
		"no headers":     {nil, `{"id": "x"}`},
		"empty event_id": {[]inbox.Header{{Key: []byte("event_id"), Value: nil}}, `{}`},
		"structured no id": {[]inbox.Header{{Key: []byte("content-type"), Value: []byte("application/cloudevents+json")}},
			`{"specversion": "1.0", "type": "t", "source": "s"}`},
	} {
		if _, err := inbox.ParseRecord(nil, rec.headers, []byte(rec.value)); !errors.Is(err, inbox.ErrNoEventID) {
			t.Errorf("%s: got %v, want ErrNoEventID", name, err)
		}
	}
	_, err := inbox.ParseRecord(nil, []inbox.Header{{Key: []byte("content-type"), Value: []byte("application/cloudevents+json; charset=utf-8")}}, []byte("not json"))
	if err == nil || errors.Is(err, inbox.ErrNoEventID) {
		t.Errorf("a structured CloudEvent that is no JSON: got %v, want an error that says so", err)
	}
}

// A hostile try found records with a version and no aggregate id (a
// Debezium-shape record with no key, a relay record without its
// aggregate_id header) accepted: with version checks they shared one
// sequence, and 3 of 5 unrelated events counted as stale and were never
// applied. Such a record cannot be read and is set aside.
func TestParseRecordRefusesAVersionWithoutAnAggregate(t *testing.T) {
	for name, headers := range map[string][]inbox.Header{
		"relay":    {{Key: []byte("event_id"), Value: []byte("e1")}, {Key: []byte("aggregate_version"), Value: []byte("1")}},
		"debezium": {{Key: []byte("id"), Value: []byte("e2")}, {Key: []byte("aggregate_version"), Value: []byte("2")}},
	} {
		if ev, err := inbox.ParseRecord(nil, headers, []byte(`{}`)); err == nil || !strings.Contains(err.Error(), "no aggregate id") {
			t.Errorf("%s: %+v, %v; want a refusal naming the missing aggregate id", name, ev, err)
		}
	}
	if _, err := inbox.ParseRecord(nil, []inbox.Header{{Key: []byte("event_id"), Value: []byte("e3")}}, []byte(`{}`)); err != nil {
		t.Errorf("a record without a version needs no aggregate id: %v", err)
	}
}
