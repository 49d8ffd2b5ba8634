package event

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	sdkevent "github.com/cloudevents/sdk-go/v2/event"

	"github.com/outbox-relay/outbox-relay/layout"
)

const testSource = "https://example.com/billing"

// ceLayout is a layout of the given table layout and header columns with
// a CloudEvents format.
func ceLayout(t *testing.T, table, format, headerColumns string) *layout.Layout {
	t.Helper()
	var columns [layout.NumColumns]string
	l, err := layout.New(table, columns, headerColumns)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.SetRecordFormat(format, testSource); err != nil {
		t.Fatal(err)
	}
	return l
}

func ceEvent(l *layout.Layout) Event {
	return Event{EventID: []byte("0192f0c1-7a3b-7c4d-8e5f-000000000001"), AggregateType: []byte("order"), AggregateID: []byte("42"),
		EventType: []byte("OrderPlaced"), SchemaVersion: []byte("2"), Payload: []byte(`{"amount": 1250}`),
		Headers:    []byte(`{"tenant": "acme", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`),
		OccurredAt: []byte("2026-11-29 21:03:56.123456+00"), Layout: l}
}

func headerList(r *Record) string {
	var b strings.Builder
	for _, h := range r.Headers {
		if h.Value == nil {
			b.WriteString(string(h.Key) + "=<null>\n")
			continue
		}
		b.WriteString(string(h.Key) + "=" + string(h.Value) + "\n")
	}
	return b.String()
}

func TestShapeOfRecordFormat(t *testing.T) {
	if s, ok := ShapeOf(ceLayout(t, layout.NameRelay, layout.FormatNameCloudEvents, "")).(CloudEvents); !ok || s.Structured {
		t.Errorf("cloudevents is %#v", s)
	}
	if s, ok := ShapeOf(ceLayout(t, layout.NameDebezium, layout.FormatNameCloudEventsStructured, "")).(CloudEvents); !ok || !s.Structured {
		t.Errorf("cloudevents-structured is %#v", s)
	}
	l, err := layout.New(layout.NameRelay, [layout.NumColumns]string{}, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := l.SetRecordFormat(layout.FormatNameDebezium, ""); err != nil {
		t.Fatal(err)
	}
	if _, ok := ShapeOf(l).(Debezium); !ok {
		t.Error("--record-format debezium on the relay's table is not the router's shape")
	}
}

// Binary content mode: the attributes in ce_ headers in the
// specification's order, then content-type, then the row's headers; the
// value is the payload as stored.
func TestCloudEventsBinaryRecord(t *testing.T) {
	ev := ceEvent(ceLayout(t, layout.NameRelay, layout.FormatNameCloudEvents, ""))
	var r Record
	if err := Build(&ev, &r); err != nil {
		t.Fatal(err)
	}
	want := "ce_specversion=1.0\nce_id=0192f0c1-7a3b-7c4d-8e5f-000000000001\nce_source=https://example.com/billing\nce_type=OrderPlaced\n" +
		"ce_subject=42\nce_time=2026-11-29T21:03:56.123456Z\ncontent-type=application/json\n" +
		"tenant=acme\ntraceparent=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n"
	if got := headerList(&r); got != want {
		t.Errorf("headers:\n%s\nwant:\n%s", got, want)
	}
	if string(r.Key) != "42" || string(r.Value) != `{"amount": 1250}` {
		t.Errorf("key %q value %q", r.Key, r.Value)
	}

	// A payload that is no JSON (a text column) is text; a NULL one is no
	// data, so no content-type; a row without occurred_at has no time.
	ev.Payload, ev.OccurredAt, ev.Headers = []byte("plain words"), nil, nil
	if err := Build(&ev, &r); err != nil {
		t.Fatal(err)
	}
	if got := string(r.Header("content-type")); got != "text/plain; charset=utf-8" || r.Header("ce_time") != nil {
		t.Errorf("text payload: content-type %q, ce_time %q", got, r.Header("ce_time"))
	}
	ev.Payload = nil
	if err := Build(&ev, &r); err != nil {
		t.Fatal(err)
	}
	if r.Value != nil || r.Header("content-type") != nil {
		t.Errorf("NULL payload: value %q, content-type %q", r.Value, r.Header("content-type"))
	}
}

// Structured content mode: the event as one JSON object, data last and
// the payload embedded as it is; the only standard header is content-type.
func TestCloudEventsStructuredRecord(t *testing.T) {
	ev := ceEvent(ceLayout(t, layout.NameRelay, layout.FormatNameCloudEventsStructured, ""))
	ev.AggregateID = []byte(`a "quoted"\id` + "\n")
	var r Record
	if err := Build(&ev, &r); err != nil {
		t.Fatal(err)
	}
	want := `{"specversion":"1.0","id":"0192f0c1-7a3b-7c4d-8e5f-000000000001","source":"https://example.com/billing","type":"OrderPlaced",` +
		`"subject":"a \"quoted\"\\id\n","time":"2026-11-29T21:03:56.123456Z","datacontenttype":"application/json","data":{"amount": 1250}}`
	if string(r.Value) != want {
		t.Errorf("value:\n%s\nwant:\n%s", r.Value, want)
	}
	if got, want := headerList(&r), "content-type=application/cloudevents+json\ntenant=acme\ntraceparent=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n"; got != want {
		t.Errorf("headers:\n%s\nwant:\n%s", got, want)
	}
	if string(r.Key) != string(ev.AggregateID) {
		t.Errorf("key %q", r.Key)
	}

	ev.Payload = []byte("caf\xc3\xa9 \x01 \xff")
	if err := Build(&ev, &r); err != nil {
		t.Fatal(err)
	}
	var decoded map[string]any
	if err := json.Unmarshal(r.Value, &decoded); err != nil {
		t.Fatalf("a text payload made a value that is no JSON: %v\n%s", err, r.Value)
	}
	if decoded["datacontenttype"] != "text/plain; charset=utf-8" || decoded["data"] != "café \x01 \uFFFD" {
		t.Errorf("text payload: %q", r.Value)
	}
	ev.Payload = nil
	if err := Build(&ev, &r); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(r.Value), `"data"`) || strings.Contains(string(r.Value), "datacontenttype") {
		t.Errorf("NULL payload has data: %s", r.Value)
	}
}

// Names the binding reads are refused in the headers column, so such an
// event is quarantined with the reason instead of published with an
// attribute it did not mean; so is a name a header column fills.
func TestCloudEventsHeaderClashes(t *testing.T) {
	for _, format := range []string{layout.FormatNameCloudEvents, layout.FormatNameCloudEventsStructured} {
		for headers, want := range map[string]string{
			`{"ce_type": "Other"}`:         `header "ce_type", which the CloudEvents binding reads`,
			`{"CE_Source": "x"}`:           `header "CE_Source", which the CloudEvents binding reads`,
			`{"ce_myextension": "x"}`:      `header "ce_myextension", which the CloudEvents binding reads`,
			`{"Content-Type": "text/xml"}`: `header "Content-Type", which the CloudEvents binding reads`,
			`{"event_id": "x"}`:            `reserved header "event_id"`,
			`{"tenant": "x"}`:              `header "tenant", which a header column fills`,
		} {
			ev := ceEvent(ceLayout(t, layout.NameDebezium, format, "tenant"))
			ev.Extra = [][]byte{[]byte("acme")}
			ev.Headers = []byte(headers)
			var r Record
			err := Build(&ev, &r)
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("%s, headers %s: error %v, want %q", format, headers, err, want)
			}
		}
	}
	var columns [layout.NumColumns]string
	l, err := layout.New(layout.NameDebezium, columns, "kind:ce_kind")
	if err != nil {
		t.Fatal(err)
	}
	if err := l.SetRecordFormat(layout.FormatNameCloudEvents, testSource); err == nil || !strings.Contains(err.Error(), `header "ce_kind" would clash`) {
		t.Errorf("a header column named ce_kind: %v", err)
	}
}

// An occurred_at that is no RFC 3339 time cannot be a time attribute.
func TestCloudEventsRefusesTimeThatIsNoRFC3339(t *testing.T) {
	ev := ceEvent(ceLayout(t, layout.NameRelay, layout.FormatNameCloudEvents, ""))
	for _, at := range []string{"infinity", "0044-03-15 12:00:00+00 BC"} {
		ev.OccurredAt = []byte(at)
		var r Record
		if err := Build(&ev, &r); err == nil || !strings.Contains(err.Error(), "no RFC 3339 time") {
			t.Errorf("occurred_at %q: %v", at, err)
		}
	}
}

// What the quarantine table keeps of a CloudEvents event, whether it
// failed before its record was built or with the record Kafka refused,
// replays as the same record, byte for byte: header columns, a text
// payload and a NULL payload included.
func TestCloudEventsStoreAndRestore(t *testing.T) {
	for _, format := range []string{layout.FormatNameCloudEvents, layout.FormatNameCloudEventsStructured} {
		relayLayout := ceLayout(t, layout.NameRelay, format, "")
		debeziumLayout := ceLayout(t, layout.NameDebezium, format, "tenant,region")
		withColumns := func(ev Event) Event {
			ev.Layout, ev.Extra, ev.SchemaVersion, ev.OccurredAt = debeziumLayout, [][]byte{[]byte("acme"), nil}, nil, nil
			ev.Headers = []byte(`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`)
			return ev
		}
		text := ceEvent(relayLayout)
		text.Payload = []byte(`a "text" payload`)
		null := withColumns(ceEvent(relayLayout))
		null.Payload = nil
		ownType := ceEvent(relayLayout)
		ownType.Payload, ownType.PayloadBinary, ownType.ContentType = []byte(`\x0aff`), true, []byte("application/x-protobuf")
		ownTypeColumns := withColumns(ceEvent(relayLayout))
		ownTypeColumns.ContentType = []byte("application/vnd.a+json")
		for name, ev := range map[string]Event{
			"relay table":               ceEvent(relayLayout),
			"text payload":              text,
			"debezium table, columns":   withColumns(ceEvent(relayLayout)),
			"debezium table, NULL data": null,
			"content type column":       ownType,
			"content type, columns":     ownTypeColumns,
		} {
			t.Run(format+"/"+name, func(t *testing.T) {
				var r Record
				if err := Build(&ev, &r); err != nil {
					t.Fatal(err)
				}
				for from, s := range map[string]Stored{"event": ev.Stored(), "record": r.Stored()} {
					var again Record
					if err := Build(Restore(&s, ev.Layout), &again); err != nil {
						t.Fatalf("from the %s: %v", from, err)
					}
					if string(again.Key) != string(r.Key) || string(again.Value) != string(r.Value) || (again.Value == nil) != (r.Value == nil) ||
						!reflect.DeepEqual(again.Headers, r.Headers) {
						t.Errorf("from the %s %+v:\nrestored key %q value %q headers\n%s\nwant key %q value %q headers\n%s",
							from, s, again.Key, again.Value, headerList(&again), r.Key, r.Value, headerList(&r))
					}
				}
			})
		}
	}
}

// Reconcile reads a structured event's id from the value.
func TestCloudEventID(t *testing.T) {
	ev := ceEvent(ceLayout(t, layout.NameRelay, layout.FormatNameCloudEventsStructured, ""))
	var r Record
	if err := Build(&ev, &r); err != nil {
		t.Fatal(err)
	}
	if id, ok := CloudEventID(r.Value); !ok || string(id) != string(ev.EventID) {
		t.Errorf("id %q, %v", id, ok)
	}
	for _, v := range []string{`{"amount": 1}`, `not json`, `{"specversion":"1.0"}`} {
		if id, ok := CloudEventID([]byte(v)); ok {
			t.Errorf("%s: id %q", v, id)
		}
	}
}

// A CloudEvent costs the record one buffer, as the other shapes do: the
// JSON check, the source, the time and the structured value allocate
// nothing more, with a row header too (more than fit in the record's own
// header array cost one more, in every shape). A per-event allocation
// would show at every rate.
func TestCloudEventsBuildAllocations(t *testing.T) {
	for _, format := range []string{layout.FormatNameCloudEvents, layout.FormatNameCloudEventsStructured} {
		ev := ceEvent(ceLayout(t, layout.NameRelay, format, ""))
		ev.Headers = []byte(`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`)
		var r Record
		allocs := testing.AllocsPerRun(1000, func() {
			if err := Build(&ev, &r); err != nil {
				t.Fatal(err)
			}
		})
		if allocs > 1 {
			t.Errorf("%s: Build allocates %.1f times per event, want 1", format, allocs)
		}
	}
}

// Issue 40.8: structured mode wrote "datacontenttype":"application/json"
// for every JSON payload whatever --content-type or the row said, and a
// row's content type that is no media type, or a structured CloudEvent's
// own, was published. The data's type is what was configured; a JSON
// payload of a type that is not JSON's goes in data as a string, and the
// stored payload is the one the record was built from either way.
func TestCloudEventsStructuredDataTakesTheConfiguredType(t *testing.T) {
	for _, c := range []struct {
		name, flag, row, payload string
		wantType                 string
		wantData                 string // the data member as JSON
	}{
		{"default", "", "", `{"a":1}`, "application/json", `{"a":1}`},
		{"flag json", "application/json; charset=utf-8", "", `{"a":1}`, "application/json; charset=utf-8", `{"a":1}`},
		{"flag json subtype", "application/vnd.acme.order+json", "", `{"a":1}`, "application/vnd.acme.order+json", `"{\"a\":1}"`},
		{"row type", "", "text/json", `{"a":1}`, "text/json", `{"a":1}`},
		{"row not json", "application/json", "text/csv", `{"a":1}`, "text/csv", `"{\"a\":1}"`},
		{"text payload", "", "", `a,b`, "text/plain; charset=utf-8", `"a,b"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			l := ceLayout(t, layout.NameRelay, layout.FormatNameCloudEventsStructured, "")
			if err := l.SetContentType(c.flag); err != nil {
				t.Fatal(err)
			}
			ev := ceEvent(l)
			ev.Payload, ev.Headers = []byte(c.payload), nil
			if c.row != "" {
				ev.ContentType = []byte(c.row)
			}
			var r Record
			if err := Build(&ev, &r); err != nil {
				t.Fatal(err)
			}
			var got map[string]json.RawMessage
			if err := json.Unmarshal(r.Value, &got); err != nil {
				t.Fatalf("value is no JSON: %v\n%s", err, r.Value)
			}
			if want, _ := json.Marshal(c.wantType); string(got["datacontenttype"]) != string(want) {
				t.Errorf("datacontenttype %s, want %s", got["datacontenttype"], want)
			}
			if string(got["data"]) != c.wantData {
				t.Errorf("data %s, want %s", got["data"], c.wantData)
			}
			// The SDK reads what the type says, and validates the event.
			var sdk sdkevent.Event
			if err := json.Unmarshal(r.Value, &sdk); err != nil {
				t.Fatalf("the SDK cannot read the event: %v", err)
			}
			if err := sdk.Validate(); err != nil || sdk.DataContentType() != c.wantType {
				t.Errorf("the SDK reads datacontenttype %q (validation: %v), want %q", sdk.DataContentType(), err, c.wantType)
			}
			if st := r.Stored(); st.Payload != c.payload {
				t.Errorf("stored payload %q, want %q as the row had it", st.Payload, c.payload)
			}
		})
	}
}

func TestCloudEventsRefuseARowContentTypeThatIsNoDataType(t *testing.T) {
	for _, format := range []string{layout.FormatNameCloudEvents, layout.FormatNameCloudEventsStructured} {
		for _, row := range []string{"bad type!!", "application/json\r\nx: y", "application/cloudevents+json", "APPLICATION/CLOUDEVENTS-BATCH+JSON"} {
			ev := ceEvent(ceLayout(t, layout.NameRelay, format, ""))
			ev.ContentType = []byte(row)
			var r Record
			err := Build(&ev, &r)
			if err == nil || !strings.Contains(err.Error(), "content-type column holds") {
				t.Errorf("%s, row content type %q: %v, want an error naming the column's value", format, row, err)
			}
		}
	}
	ev := ceEvent(nil)
	ev.Layout = &layout.Layout{}
	ev.ContentType = []byte("bad type!!")
	if err := Build(&ev, &Record{}); err == nil {
		t.Error("the relay's format sent a content-type header that is no media type")
	}
}
