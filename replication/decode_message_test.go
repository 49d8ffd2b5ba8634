package replication

import (
	"github.com/outbox-relay/outbox-relay/layout"
	"strings"
	"testing"
)

// messageMsg is a pgoutput logical decoding message.
func messageMsg(transactional bool, at uint64, prefix, content string) []byte {
	flags := byte(0)
	if transactional {
		flags = 1
	}
	w := wire{}.u8('M').u8(flags).u64(at).str(prefix).u32(uint32(len(content)))
	return append(w, content...)
}

// The messages source publishes only transactional messages of its prefix;
// the others come back as skipped, saying why, and the table source never
// looks at messages at all.
func TestDecodeMessages(t *testing.T) {
	const content = `{"event_id": "0B5A1D64-8B0E-4C7A-9C53-1D2E3F405162", "aggregate_type": "order", "aggregate_id": "o-1", "event_type": "Placed", "payload": {"a": 1}, "occurred_at": "2026-12-02T10:00:00.5+01:00"}`
	d := newMessageDecoder("outbox")
	var m Message
	begin := wire{}.u8('B').u64(0x1000).u64(0).u32(7)
	if err := d.decode(begin, &m); err != nil {
		t.Fatal(err)
	}
	if err := d.decode(messageMsg(true, 0x0F00, "outbox", content), &m); err != nil || m.Kind != KindRow || m.Row.Unmapped != "" {
		t.Fatalf("transactional message: %v %+v", err, m)
	}
	v := m.Row.Values
	for f, want := range map[layout.Field]string{
		FieldEventID: "0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162", FieldAggregateType: "order", FieldAggregateID: "o-1",
		FieldEventType: "Placed", FieldPayload: `{"a": 1}`, FieldSchemaVersion: "1", FieldOccurredAt: "2026-12-02 09:00:00.5+00",
	} {
		if string(v[f]) != want {
			t.Errorf("field %d = %q, want %q", f, v[f], want)
		}
	}
	if v[FieldHeaders] != nil {
		t.Errorf("headers %q, want NULL", v[FieldHeaders])
	}
	for _, c := range []struct {
		msg  []byte
		want Skip
	}{
		{messageMsg(false, 0x0F10, "outbox", content), SkipNonTransactional},
		{messageMsg(true, 0x0F20, "other", content), SkipOtherPrefix},
		{messageMsg(false, 0x0F30, "outbox-2", content), SkipOtherPrefix},
	} {
		if err := d.decode(c.msg, &m); err != nil || m.Kind != KindSkippedMessage || m.Skipped != c.want {
			t.Errorf("message %q: %v kind %d skipped %d, want skipped %d", c.msg, err, m.Kind, m.Skipped, c.want)
		}
	}
	table := newDecoder("public", "outbox_events", layout.Relay)
	if err := table.decode(messageMsg(true, 0x0F40, "outbox", content), &m); err != nil || m.Kind != KindOther {
		t.Errorf("table source read a message: %v kind %d", err, m.Kind)
	}
	// A content that is no event becomes a row that says so, with an ID
	// that names the message, so it can be quarantined.
	if err := d.decode(messageMsg(true, 0x0F50, "outbox", `{"aggregate_id": 5}`), &m); err != nil || m.Kind != KindRow {
		t.Fatalf("bad content: %v %+v", err, m)
	}
	if !strings.Contains(m.Row.Unmapped, "aggregate_id is not a string") || len(m.Row.Values[FieldEventID]) != 36 {
		t.Errorf("bad content: unmapped %q, event id %q", m.Row.Unmapped, m.Row.Values[FieldEventID])
	}
	if err := d.decode(wire{}.u8('M').u8(1).u64(1).str("outbox").u32(50), &m); err == nil {
		t.Error("a content shorter than its length decoded")
	}
}
