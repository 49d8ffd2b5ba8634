package event

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/layout"
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

func TestShapeOf(t *testing.T) {
	if _, ok := ShapeOf(nil).(Relay); !ok {
		t.Error("no layout is not the relay's shape")
	}
	if _, ok := ShapeOf(layout.Relay).(Relay); !ok {
		t.Error("the relay's layout is not the relay's shape")
	}
	if _, ok := ShapeOf(debeziumLayout(t, "")).(Debezium); !ok {
		t.Error("Debezium's layout is not the router's shape")
	}
}

// What the quarantine table keeps of an event, whether it failed before
// its record was built or with the record, restores to the event it was:
// replay publishes the same record again.
func TestStoreAndRestore(t *testing.T) {
	for _, tc := range []struct {
		name string
		ev   Event
		// anyOrder: the replay sends the same headers, in another order
		// (a column's content type comes back as a row header, after
		// the header columns).
		anyOrder bool
	}{
		{"relay", Event{EventID: []byte("e1"), AggregateType: []byte("order"), AggregateID: []byte("42"), EventType: []byte("Placed"),
			SchemaVersion: []byte("2"), Payload: []byte(`{"a":1}`), Headers: []byte(`{"tenant":"acme"}`),
			OccurredAt: []byte("2026-11-29T21:03:56Z"), Layout: layout.Relay}, false},
		{"debezium", Event{EventID: []byte("e2"), AggregateType: []byte("order"), AggregateID: []byte("42"), EventType: []byte("Placed"),
			Payload: []byte(`{"a":1}`), Extra: [][]byte{[]byte("acme"), nil}, Layout: debeziumLayout(t, "tenant,region")}, false},
		{"relay, content type column", Event{EventID: []byte("e4"), AggregateType: []byte("order"), AggregateID: []byte("42"), EventType: []byte("Placed"),
			SchemaVersion: []byte("1"), Payload: []byte(`\x0aff`), PayloadBinary: true, Headers: []byte(`{"tenant":"acme"}`),
			ContentType: []byte("application/x-protobuf"), OccurredAt: []byte("2026-11-29T21:03:56Z"), Layout: layout.Relay}, false},
		{"debezium, content type column", Event{EventID: []byte("e5"), AggregateType: []byte("order"), AggregateID: []byte("42"),
			Payload: []byte(`{"a":1}`), Extra: [][]byte{[]byte("acme"), nil}, ContentType: []byte("application/vnd.a+json"), Layout: debeziumLayout(t, "tenant,region")}, true},
		{"debezium, NULL payload", Event{EventID: []byte("e3"), AggregateType: []byte("order"), AggregateID: []byte("42"),
			Extra: [][]byte{nil, []byte("eu")}, Layout: debeziumLayout(t, "tenant,region")}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var r Record
			if err := Build(&tc.ev, &r); err != nil {
				t.Fatal(err)
			}
			fromEvent, fromRecord := tc.ev.Stored(), r.Stored()
			if !reflect.DeepEqual(fromEvent, fromRecord) {
				t.Errorf("stored from the event %+v, from its record %+v", fromEvent, fromRecord)
			}
			for _, s := range []Stored{fromEvent, fromRecord} {
				var again Record
				if err := Build(Restore(&s, tc.ev.Layout), &again); err != nil {
					t.Fatal(err)
				}
				want, got := r.Headers, again.Headers
				if tc.anyOrder {
					byKey := func(a, b Header) int { return strings.Compare(string(a.Key), string(b.Key)) }
					want, got = slices.SortedFunc(slices.Values(want), byKey), slices.SortedFunc(slices.Values(got), byKey)
				}
				if string(again.Key) != string(r.Key) || string(again.Value) != string(r.Value) || (again.Value == nil) != (r.Value == nil) ||
					!reflect.DeepEqual(got, want) {
					t.Errorf("restored record %+v, want %+v", again, r)
				}
			}
		})
	}
}
