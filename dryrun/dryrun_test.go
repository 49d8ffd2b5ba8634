package dryrun

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/sink"
)

// Bytes that are not UTF-8 are printed in base64 in a field of their own,
// so what is printed is exactly what Kafka would get; a partition lookup
// that fails is printed beside the record, which is still acknowledged.
func TestPrintsBytesExactlyAndAcksEachRecord(t *testing.T) {
	var out bytes.Buffer
	partition := func(topic string, key []byte) (int32, error) {
		if topic == "missing" {
			return -1, errors.New("look up topic missing: unknown topic")
		}
		return 4, nil
	}
	topic := func(ev *event.Event) string { return string(ev.AggregateType) }
	p := NewPrinter(&out, topic, partition)
	snk, err := p.NewSink()
	if err != nil {
		t.Fatal(err)
	}
	events := []*event.Event{
		{EventID: []byte("0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162"), AggregateType: []byte("orders"), AggregateID: []byte("o-1"),
			EventType: []byte("Placed"), Payload: []byte(`{"a": "é"}`), Txn: 7},
		{EventID: []byte("1b5a1d64-8b0e-4c7a-9c53-1d2e3f405162"), AggregateType: []byte("missing"), AggregateID: []byte("\xff\xfe"),
			EventType: []byte("Placed"), Payload: []byte("\x00\xff"), PayloadBinary: true, Txn: 8},
	}
	for _, ev := range events {
		rec, err := snk.Build(ev)
		if err != nil {
			t.Fatal(err)
		}
		snk.Input() <- sink.Item{Record: rec}
		select {
		case o := <-snk.Outcomes():
			if o.Err != nil || o.Txn != ev.Txn || o.Topic != string(ev.AggregateType) {
				t.Fatalf("outcome %+v for event %s", o, ev.EventID)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no outcome")
		}
	}
	if err := snk.Close(time.Second); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d lines: %s", len(lines), out.String())
	}
	var first, second map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &first); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(lines[1]), &second); err != nil {
		t.Fatal(err)
	}
	if first["topic"] != "orders" || first["partition"] != 4.0 || first["key"] != "o-1" || first["value"] != `{"a": "é"}` {
		t.Errorf("first line %s", lines[0])
	}
	if second["partition"] != nil || !strings.Contains(second["partition_error"].(string), "unknown topic") ||
		second["key"] != nil || second["key_base64"] != base64.StdEncoding.EncodeToString([]byte("\xff\xfe")) {
		t.Errorf("second line %s", lines[1])
	}
	if second["value"] == nil && second["value_base64"] == nil {
		t.Errorf("second line has no value: %s", lines[1])
	}
}
