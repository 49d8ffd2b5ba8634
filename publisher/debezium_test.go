package publisher

import (
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/sink"
)

func debeziumLayout(t *testing.T, headerColumns string) *layout.Layout {
	t.Helper()
	var columns [layout.NumColumns]string
	l, err := layout.New(layout.NameDebezium, columns, headerColumns)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// In Debezium's layout the record is the router's: key the aggregate id,
// value the payload (nil for a SQL NULL, the four bytes null for JSON
// null), headers exactly "id" and the header columns in order, a NULL
// column as a null value; none of the relay's standard headers.
func TestBuildDebeziumRecord(t *testing.T) {
	l := debeziumLayout(t, "tenant,region")
	for _, tc := range []struct {
		name    string
		payload []byte
		extra   [][]byte
	}{
		{"object", []byte(`{"total": 12.5}`), [][]byte{[]byte("acme"), []byte("eu")}},
		{"SQL NULL payload", nil, [][]byte{[]byte("acme"), nil}},
		{"JSON null payload", []byte("null"), [][]byte{nil, []byte("eu")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev := &event.Event{EventID: []byte("0b7e7f2e-6d5f-4c1e-9b7a-2f0d6c1a9e01"), AggregateType: []byte("order"),
				AggregateID: []byte("order-42"), EventType: []byte("OrderPlaced"), Payload: tc.payload, Extra: tc.extra, Layout: l}
			if perr := sink.CheckRow(ev); perr != nil {
				t.Fatalf("row check: %v", perr)
			}
			r, err := BuildRecord(ev, "outbox.event.order")
			if err != nil {
				t.Fatal(err)
			}
			if string(r.Key()) != "order-42" || r.Topic() != "outbox.event.order" {
				t.Fatalf("key %q topic %q", r.Key(), r.Topic())
			}
			value, _ := r.msg.Value.Encode()
			if (value == nil) != (tc.payload == nil) || string(value) != string(tc.payload) {
				t.Fatalf("value %q (nil %v), want %q (nil %v)", value, value == nil, tc.payload, tc.payload == nil)
			}
			want := []struct {
				key   string
				value []byte
			}{{"id", ev.EventID}, {"tenant", tc.extra[0]}, {"region", tc.extra[1]}}
			if len(r.msg.Headers) != len(want) {
				t.Fatalf("%d headers, want %d", len(r.msg.Headers), len(want))
			}
			for i, w := range want {
				h := r.msg.Headers[i]
				if string(h.Key) != w.key || string(h.Value) != string(w.value) || (h.Value == nil) != (w.value == nil) {
					t.Errorf("header %d = %s:%q (nil %v), want %s:%q (nil %v)", i, h.Key, h.Value, h.Value == nil, w.key, w.value, w.value == nil)
				}
			}
			if rec := r.Shaped(); string(rec.AggregateType) != "order" || string(rec.EventType) != "OrderPlaced" || r.Size() != r.msg.ByteSize(2) {
				t.Fatalf("aggregate type %q event type %q size %d", rec.AggregateType, rec.EventType, r.Size())
			}
		})
	}
}

// A NULL event type is fine in Debezium's layout, which places it nowhere;
// a NULL aggregate id or type still is not.
func TestCheckRowDebezium(t *testing.T) {
	l := debeziumLayout(t, "")
	ev := &event.Event{EventID: []byte("e"), AggregateType: []byte("order"), AggregateID: []byte("1"), Layout: l}
	if perr := sink.CheckRow(ev); perr != nil {
		t.Fatalf("NULL type and payload refused: %v", perr)
	}
	ev.AggregateID = nil
	if perr := sink.CheckRow(ev); perr == nil || !strings.Contains(perr.Error(), "aggregateid") {
		t.Fatalf("NULL aggregateid: %v, want an error naming the column", perr)
	}
	ev.Layout = nil
	ev.AggregateID = []byte("1")
	if perr := sink.CheckRow(ev); perr == nil {
		t.Fatal("the relay's layout took a NULL payload and event type")
	}
}

// The router's shape costs no more allocations than the relay's (the
// record and its byte buffer), with header columns too.
func TestBuildDebeziumAllocations(t *testing.T) {
	ev := &event.Event{EventID: []byte("0b7e7f2e-6d5f-4c1e-9b7a-2f0d6c1a9e01"), AggregateType: []byte("order"),
		AggregateID: []byte("order-42"), Payload: []byte(`{"a": 1}`), Extra: [][]byte{[]byte("acme"), nil},
		Layout: debeziumLayout(t, "tenant,region")}
	allocs := testing.AllocsPerRun(1000, func() {
		if _, err := build(ev, "t"); err != nil {
			t.Fatal(err)
		}
	})
	if allocs > 2 {
		t.Fatalf("build allocates %.1f times per event, want at most 2", allocs)
	}
}
