package messages

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/layout"
)

var commit = time.Date(2026, 12, 2, 10, 0, 0, 123456000, time.UTC)

// A content decodes to the text the table source's WAL row would carry for
// the same event: canonical uuid, unescaped strings, the payload and
// headers as written, occurred_at as PostgreSQL prints a timestamptz in UTC.
func TestDecodeIsTheTableSourceText(t *testing.T) {
	var d Decoder
	var v Values
	content := `{"event_id":"{0B5A1D64-8B0E-4C7A-9C53-1D2E3F405162}", "aggregate_type":"or\"der", "aggregate_id":"o-1\u00e9",
		"event_type":"Placed", "schema_version": 3, "payload": {"b": [1, {"c": "}"}], "a": null},
		"headers": {"tenant": "acme"}, "occurred_at": "2026-12-02T11:00:00.0000004+01:00", "future_member": [1]}`
	if p := d.Decode([]byte(content), 1, commit, &v); p != "" {
		t.Fatal(p)
	}
	for f, want := range map[layout.Field]string{
		layout.EventID: "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", layout.AggregateType: `or"der`, layout.AggregateID: "o-1é",
		layout.EventType: "Placed", layout.SchemaVersion: "3", layout.Payload: `{"b": [1, {"c": "}"}], "a": null}`,
		layout.Headers: `{"tenant": "acme"}`, layout.OccurredAt: "2026-12-02 10:00:00+00",
	} {
		if string(v[f]) != want {
			t.Errorf("field %d = %q, want %q", f, v[f], want)
		}
	}
	// Defaults: schema version 1, no headers, the commit time.
	if p := d.Decode([]byte(`{"event_id":"0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162","aggregate_type":"a","aggregate_id":"b","event_type":"c","payload":1,"headers":null}`), 1, commit, &v); p != "" {
		t.Fatal(p)
	}
	if string(v[layout.SchemaVersion]) != "1" || v[layout.Headers] != nil || string(v[layout.OccurredAt]) != "2026-12-02 10:00:00.123456+00" {
		t.Errorf("defaults: %q", v)
	}
}

// A content that is no outbox event says every problem, and still yields
// an event ID and a payload, so the quarantine table can keep it.
func TestDecodeNamesTheProblem(t *testing.T) {
	for _, c := range []struct{ content, want string }{
		{`not json`, "not valid JSON"},
		{`[1, 2]`, "not a JSON object"},
		{`{"event_id": "x", "aggregate_type": "a", "aggregate_id": "b", "event_type": "c", "payload": {}}`, `event_id "x" is not a UUID`},
		{`{"event_id": "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", "payload": {}}`, "no aggregate_type, aggregate_id, event_type"},
		{`{"event_id": "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", "aggregate_type": "a", "aggregate_id": "b", "event_type": "c", "payload": {}, "schema_version": 1.5}`, "schema_version 1.5 is not an integer"},
		{`{"event_id": "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", "aggregate_type": "a", "aggregate_id": "b", "event_type": "c", "payload": {}, "headers": [1]}`, "headers is not a JSON object"},
		{`{"event_id": "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", "aggregate_type": "a", "aggregate_id": "b", "event_type": "c", "payload": {}, "occurred_at": "yesterday"}`, `occurred_at "yesterday" is not an RFC 3339 time`},
	} {
		var d Decoder
		var v Values
		p := d.Decode([]byte(c.content), 0xABC, commit, &v)
		if !strings.Contains(p, c.want) {
			t.Errorf("%s: problem %q, want it to say %q", c.content, p, c.want)
		}
		if len(v[layout.EventID]) != 36 || !json.Valid(v[layout.Payload]) {
			t.Errorf("%s: event id %q payload %q: not fit for the quarantine table", c.content, v[layout.EventID], v[layout.Payload])
		}
	}
	var d Decoder
	var v Values
	d.Decode([]byte("not json"), 0xABC, commit, &v)
	if string(v[layout.Payload]) != `"not json"` {
		t.Errorf("payload %q, want the content as a JSON string", v[layout.Payload])
	}
	first := string(v[layout.EventID])
	d.Decode([]byte("not json either"), 0xABC, commit, &v)
	if string(v[layout.EventID]) != first {
		t.Error("the derived event ID of one WAL position changed")
	}
}

// Decoding a valid content allocates nothing once the decoder is warm: it
// runs once per event on the relay's read path.
func TestDecodeAllocations(t *testing.T) {
	content := []byte(`{"event_id": "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", "aggregate_type": "order", "aggregate_id": "o-1", "event_type": "Placed", "schema_version": 1, "payload": {"a": 1, "pad": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}, "headers": {"tenant": "acme"}, "occurred_at": "2026-12-02T10:00:00.123456+00:00"}`)
	var d Decoder
	var v Values
	allocs := testing.AllocsPerRun(100, func() { d.Decode(content, 1, commit, &v) })
	t.Logf("%.1f allocations per content", allocs)
	if allocs > 3 {
		t.Errorf("%.1f allocations per content", allocs)
	}
}

func BenchmarkDecode(b *testing.B) {
	content := []byte(`{"event_id": "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", "aggregate_type": "order", "aggregate_id": "o-1", "event_type": "Placed", "schema_version": 1, "payload": {"a": 1, "pad": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}, "headers": {"tenant": "acme"}, "occurred_at": "2026-12-02T10:00:00.123456+00:00"}`)
	var d Decoder
	var v Values
	b.ReportAllocs()
	for b.Loop() {
		d.Decode(content, 1, commit, &v)
	}
}

// A binary payload comes as payload_base64 and becomes the bytes' bytea
// text form, as a bytea column's value arrives; a content with both
// members, or base64 that does not decode, is no outbox event.
func TestPayloadBase64(t *testing.T) {
	var d Decoder
	var v Values
	commit := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	const event = `{"event_id": "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", "aggregate_type": "a", "aggregate_id": "b", "event_type": "c", `
	if p := d.Decode([]byte(event+`"payload_base64": "AID/XHg="}`), 1, commit, &v); p != "" || !d.PayloadBinary() || string(v[layout.Payload]) != `\x0080ff5c78` {
		t.Errorf("problem %q, binary %v, payload %q", p, d.PayloadBinary(), v[layout.Payload])
	}
	if p := d.Decode([]byte(event+`"payload": {"a": 1}}`), 2, commit, &v); p != "" || d.PayloadBinary() {
		t.Errorf("a JSON payload after a binary one: problem %q, binary %v", p, d.PayloadBinary())
	}
	for _, c := range []struct{ members, want string }{
		{`"payload": {}, "payload_base64": "AA=="`, "both payload and payload_base64"},
		{`"payload_base64": "AA==", "payload": {}`, "both payload and payload_base64"},
		{`"payload_base64": "not base64!"`, "payload_base64 is not base64"},
		{`"payload_base64": 1`, "payload_base64 is not a string"},
	} {
		if p := d.Decode([]byte(event+c.members+"}"), 3, commit, &v); !strings.Contains(p, c.want) || v[layout.Payload] == nil {
			t.Errorf("%s: problem %q, payload %q; want %q", c.members, p, v[layout.Payload], c.want)
		}
	}
}

// Issue 40.11c: a content with two event_id members took the second
// silently, and a second payload was reported as "both payload and
// payload_base64". Any member given twice, ours or not, makes the content
// no event, and the problem names each such member once.
func TestDecodeRefusesDuplicateMembers(t *testing.T) {
	const id = `"event_id": "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", `
	const rest = `"aggregate_type": "a", "aggregate_id": "b", "event_type": "c", "payload": {}`
	for _, c := range []struct{ content, want, not string }{
		{`{` + id + `"event_id": "1b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", ` + rest + `}`, `duplicate member "event_id"`, ""},
		{`{` + id + rest + `, "payload": {"second": true}}`, `duplicate member "payload"`, "payload_base64"},
		{`{` + id + rest + `, "extra": 1, "extra": 2, "extra": 3}`, `duplicate member "extra"`, `"extra", "extra"`},
		{`{` + id + rest + `, "aggregate_type": "z", "x\u0041": 1, "xA": 2}`, `duplicate members "aggregate_type", "xA"`, ""},
	} {
		var d Decoder
		var v Values
		p := d.Decode([]byte(c.content), 7, commit, &v)
		if !strings.Contains(p, c.want) || c.not != "" && strings.Contains(p, c.not) {
			t.Errorf("%s: problem %q, want it to say %q (and not %q)", c.content, p, c.want, c.not)
		}
	}
	// Many distinct members are no duplicates.
	var b strings.Builder
	b.WriteString(`{` + id + rest)
	for i := range 100 {
		fmt.Fprintf(&b, `, "m%d": %d`, i, i)
	}
	b.WriteString("}")
	var d Decoder
	var v Values
	if p := d.Decode([]byte(b.String()), 7, commit, &v); p != "" {
		t.Errorf("100 distinct extra members: %s", p)
	}
}

// Issue 40.10: a content that is no event was quarantined without
// occurred_at, and replay then sent an empty occurred_at header. Like a
// valid event's, its occurred_at is the commit time when it has none.
func TestProblemContentKeepsTheCommitTime(t *testing.T) {
	for _, content := range []string{`not json`, `{"event_id": "x", "payload_base64": "!"}`} {
		var d Decoder
		var v Values
		if p := d.Decode([]byte(content), 7, commit, &v); p == "" {
			t.Fatalf("%s: no problem", content)
		}
		if string(v[layout.OccurredAt]) != "2026-12-02 10:00:00.123456+00" {
			t.Errorf("%s: occurred_at %q, want the commit time", content, v[layout.OccurredAt])
		}
	}
}

// A problem quotes a writer's value only in part: it reaches error
// messages and log lines, which must not carry a content whole.
func TestProblemQuotesAValueInPart(t *testing.T) {
	long := strings.Repeat("x", 10_000)
	var d Decoder
	var v Values
	p := d.Decode([]byte(`{"event_id": "`+long+`", "aggregate_type": "a", "aggregate_id": "b", "event_type": "c", "payload": {}, "occurred_at": "`+long+`"}`), 7, commit, &v)
	if len(p) > 600 || !strings.Contains(p, "is not a UUID") || !strings.Contains(p, "is not an RFC 3339 time") {
		t.Errorf("problem of %d bytes: %.300s", len(p), p)
	}
}
