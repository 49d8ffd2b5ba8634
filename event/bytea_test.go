package event

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"reflect"
	"testing"

	"github.com/outbox-relay/outbox-relay/layout"
)

// notUTF8 is a payload no text column could hold: a NUL, a lone
// continuation byte, a backslash and 0xff.
var notUTF8 = []byte{0x00, 0x80, '\\', 'x', 0xff, 0xfe, 'a'}

// PostgreSQL writes bytea as hex (bytea_output = hex, the default) or, on
// a server configured for the old escape format, as escapes; both come
// back as the same bytes.
func TestAppendBytea(t *testing.T) {
	for _, tc := range []struct{ text, want string }{
		{`\x`, ""},
		{`\x00805c78fffe61`, string(notUTF8)},
		{`\x00805C78FFFE61`, string(notUTF8)},
		{`\000\200\\x\377\376a`, string(notUTF8)},
		{``, ""},
	} {
		got, err := appendBytea(nil, []byte(tc.text))
		if err != nil || string(got) != tc.want {
			t.Errorf("%s: %q, %v; want %q", tc.text, got, err, tc.want)
		}
	}
	for _, bad := range []string{`\x0`, `\xzz`, `a\`, `\9`, `\400`} {
		if got, err := appendBytea(nil, []byte(bad)); err == nil {
			t.Errorf("%s: %q, want an error", bad, got)
		}
	}
	if got := byteaText(notUTF8); got != `\x00805c78fffe61` {
		t.Errorf("byteaText %s", got)
	}
}

func binaryEvent(l *layout.Layout) Event {
	ev := ceEvent(l)
	ev.Payload, ev.PayloadBinary = []byte(byteaText(notUTF8)), true
	return ev
}

func relayLayout(t *testing.T) *layout.Layout {
	t.Helper()
	l, err := layout.New(layout.NameRelay, [layout.NumColumns]string{}, "")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func withContentType(t *testing.T, l *layout.Layout, contentType string) *layout.Layout {
	t.Helper()
	if err := l.SetContentType(contentType); err != nil {
		t.Fatal(err)
	}
	return l
}

// A bytea payload becomes the record's value as its bytes in every shape
// but structured CloudEvents, where it is data_base64; content-type is
// --content-type's, or in CloudEvents application/octet-stream, and only
// CloudEvents sends one unasked. What the quarantine table keeps of it
// replays as the same record.
func TestBinaryPayload(t *testing.T) {
	const protobuf = "application/x-protobuf"
	for _, tc := range []struct {
		name        string
		layout      *layout.Layout
		contentType string // the header's value; "" for none
	}{
		{"relay", layout.Relay, ""},
		{"relay, --content-type", withContentType(t, relayLayout(t), protobuf), protobuf},
		{"debezium", debeziumLayout(t, "tenant"), ""},
		{"debezium, --content-type", withContentType(t, debeziumLayout(t, "tenant"), protobuf), protobuf},
		{"cloudevents", ceLayout(t, layout.NameRelay, layout.FormatNameCloudEvents, ""), "application/octet-stream"},
		{"cloudevents, --content-type", withContentType(t, ceLayout(t, layout.NameRelay, layout.FormatNameCloudEvents, ""), protobuf), protobuf},
		{"cloudevents-structured", ceLayout(t, layout.NameRelay, layout.FormatNameCloudEventsStructured, ""), "application/octet-stream"},
		{"cloudevents-structured, --content-type", withContentType(t, ceLayout(t, layout.NameRelay, layout.FormatNameCloudEventsStructured, ""), protobuf), protobuf},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev := binaryEvent(tc.layout)
			if len(tc.layout.HeaderColumns) > 0 {
				ev.Extra = [][]byte{[]byte("acme")}
				ev.Headers = nil
			}
			var r Record
			if err := Build(&ev, &r); err != nil {
				t.Fatal(err)
			}
			if tc.layout.RecordFormat() == layout.FormatCloudEventsStructured {
				var ce struct {
					DataContentType string          `json:"datacontenttype"`
					DataBase64      string          `json:"data_base64"`
					Data            json.RawMessage `json:"data"`
				}
				if err := json.Unmarshal(r.Value, &ce); err != nil {
					t.Fatalf("%s: %v", r.Value, err)
				}
				data, err := base64.StdEncoding.DecodeString(ce.DataBase64)
				if err != nil || !bytes.Equal(data, notUTF8) || ce.Data != nil || ce.DataContentType != tc.contentType {
					t.Errorf("value %s: data %q (%v), datacontenttype %q", r.Value, data, err, ce.DataContentType)
				}
			} else {
				if !bytes.Equal(r.Value, notUTF8) {
					t.Errorf("value %q, want %q", r.Value, notUTF8)
				}
				if got := string(r.Header("content-type")); got != tc.contentType {
					t.Errorf("content-type %q, want %q; headers\n%s", got, tc.contentType, headerList(&r))
				}
			}
			fromEvent, fromRecord := ev.Stored(), r.Stored()
			for from, s := range map[string]Stored{"event": fromEvent, "record": fromRecord} {
				if !s.PayloadBinary || s.Payload != byteaText(notUTF8) {
					t.Errorf("stored from the %s: payload %q, binary %v", from, s.Payload, s.PayloadBinary)
				}
				// Through JSON, as the quarantine list shows it.
				b, err := json.Marshal(s)
				if err != nil {
					t.Fatal(err)
				}
				var back Stored
				if err := json.Unmarshal(b, &back); err != nil {
					t.Fatal(err)
				}
				var again Record
				if err := Build(Restore(&back, ev.Layout), &again); err != nil {
					t.Fatalf("from the %s: %v", from, err)
				}
				if string(again.Key) != string(r.Key) || !bytes.Equal(again.Value, r.Value) || !reflect.DeepEqual(again.Headers, r.Headers) {
					t.Errorf("from the %s %+v:\nrestored value %q headers\n%s\nwant value %q headers\n%s",
						from, back, again.Value, headerList(&again), r.Value, headerList(&r))
				}
			}
		})
	}
}

// A row's own content-type header wins over --content-type, and is kept
// as the row's when the event is quarantined.
func TestRowContentTypeWins(t *testing.T) {
	l := withContentType(t, relayLayout(t), "application/x-protobuf")
	ev := binaryEvent(l)
	ev.Headers = []byte(`{"content-type": "application/vnd.acme+proto"}`)
	var r Record
	if err := Build(&ev, &r); err != nil {
		t.Fatal(err)
	}
	if got := headerList(&r); bytes.Count([]byte(got), []byte("content-type=")) != 1 || string(r.Header("content-type")) != "application/vnd.acme+proto" {
		t.Errorf("headers\n%s", got)
	}
	if s := r.Stored(); s.Headers != `{"content-type":"application/vnd.acme+proto"}` {
		t.Errorf("stored headers %s", s.Headers)
	}
}

// A payload that is no bytea text form (which PostgreSQL never sends)
// fails its event, so it is quarantined rather than sent as garbage.
func TestBinaryPayloadThatDoesNotParse(t *testing.T) {
	for _, l := range []*layout.Layout{layout.Relay, debeziumLayout(t, ""),
		ceLayout(t, layout.NameRelay, layout.FormatNameCloudEvents, ""), ceLayout(t, layout.NameRelay, layout.FormatNameCloudEventsStructured, "")} {
		ev := binaryEvent(l)
		ev.Payload = []byte(`\x0`)
		var r Record
		if err := Build(&ev, &r); err == nil {
			t.Errorf("%s: built %q", l.RecordFormat(), r.Value)
		}
	}
}

// Decoding a binary payload costs nothing beyond the record's one buffer
// in the shapes that send the bytes as they are.
func TestBinaryPayloadAllocations(t *testing.T) {
	for _, l := range []*layout.Layout{layout.Relay, ceLayout(t, layout.NameRelay, layout.FormatNameCloudEvents, "")} {
		ev := binaryEvent(l)
		ev.Headers = nil
		var r Record
		allocs := testing.AllocsPerRun(1000, func() {
			if err := Build(&ev, &r); err != nil {
				t.Fatal(err)
			}
		})
		if allocs > 1 {
			t.Errorf("%s: Build allocates %.1f times per event, want 1", l.RecordFormat(), allocs)
		}
	}
}
