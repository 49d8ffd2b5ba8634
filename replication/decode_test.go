package replication

import (
	"encoding/binary"
	mrand "math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
)

// wire builds pgoutput messages by hand, as the server sends them.
type wire []byte

func (w wire) u8(v byte) wire     { return append(w, v) }
func (w wire) u16(v uint16) wire  { return binary.BigEndian.AppendUint16(w, v) }
func (w wire) u32(v uint32) wire  { return binary.BigEndian.AppendUint32(w, v) }
func (w wire) u64(v uint64) wire  { return binary.BigEndian.AppendUint64(w, v) }
func (w wire) str(s string) wire  { return append(append(w, s...), 0) }
func (w wire) text(s string) wire { return append(w.u8('t').u32(uint32(len(s))), s...) }

func relationMsg(oid uint32, schema, table string, cols ...string) []byte {
	w := wire{}.u8('R').u32(oid).str(schema).str(table).u8('d').u16(uint16(len(cols)))
	for _, c := range cols {
		w = w.u8(0).str(c).u32(25).u32(0xffffffff)
	}
	return w
}

// insertMsg takes one value per column; "\x00null" stands for SQL NULL.
func insertMsg(oid uint32, values ...string) []byte {
	w := wire{}.u8('I').u32(oid).u8('N').u16(uint16(len(values)))
	for _, v := range values {
		if v == "\x00null" {
			w = w.u8('n')
		} else {
			w = w.text(v)
		}
	}
	return w
}

var outboxCols = []string{"event_id", "aggregate_type", "aggregate_id", "event_type", "schema_version", "payload", "headers", "occurred_at", "created_at"}

func TestDecodeTransaction(t *testing.T) {
	d := newDecoder("public", "outbox_events", layout.Relay)
	var m Message

	commitMicros := int64(123456789)
	begin := wire{}.u8('B').u64(0x1000).u64(uint64(commitMicros)).u32(777)
	if err := d.decode(begin, &m); err != nil || m.Kind != KindBegin || m.XID != 777 || m.CommitLSN != 0x1000 {
		t.Fatalf("begin: %v %+v", err, m)
	}
	if want := time.Date(2000, 1, 1, 0, 2, 3, 456789000, time.UTC); !m.CommitTime.Equal(want) {
		t.Fatalf("commit time %v, want %v", m.CommitTime, want)
	}
	if err := d.decode(relationMsg(16384, "public", "outbox_events", outboxCols...), &m); err != nil || m.Kind != KindOther {
		t.Fatalf("relation: %v", err)
	}
	ins := insertMsg(16384, "id-1", "order", "o-1", "Placed", "1", `{"a": 1}`, "\x00null", "2026-01-01 00:00:00+00", "2026-01-01 00:00:00+00")
	if err := d.decode(ins, &m); err != nil || m.Kind != KindRow {
		t.Fatalf("insert: %v %+v", err, m)
	}
	v := m.Row.Values
	if string(v[FieldEventID]) != "id-1" || string(v[FieldAggregateID]) != "o-1" || string(v[FieldPayload]) != `{"a": 1}` ||
		v[FieldHeaders] != nil || string(v[FieldOccurredAt]) != "2026-01-01 00:00:00+00" {
		t.Fatalf("row %q", v)
	}
	commit := wire{}.u8('C').u8(0).u64(0x1000).u64(0x1030).u64(uint64(commitMicros))
	if err := d.decode(commit, &m); err != nil || m.Kind != KindCommit || m.CommitLSN != 0x1000 || m.EndLSN != 0x1030 {
		t.Fatalf("commit: %v %+v", err, m)
	}
}

// After ALTER TABLE the server sends the relation again; columns are mapped
// by name, so an added or reordered column changes nothing.
func TestDecodeRelationChangeMapsByName(t *testing.T) {
	d := newDecoder("public", "outbox_events", layout.Relay)
	var m Message
	cols := []string{"extra_first", "payload", "aggregate_id", "event_id", "aggregate_type", "event_type"}
	if err := d.decode(relationMsg(1, "public", "outbox_events", cols...), &m); err != nil {
		t.Fatal(err)
	}
	if err := d.decode(insertMsg(1, "zzz", `{}`, "agg", "id", "type", "evt"), &m); err != nil {
		t.Fatal(err)
	}
	v := m.Row.Values
	if string(v[FieldEventID]) != "id" || string(v[FieldAggregateID]) != "agg" || string(v[FieldPayload]) != "{}" || v[FieldSchemaVersion] != nil {
		t.Fatalf("row %q", v)
	}
}

func TestDecodeOtherTablesAndMessagesAreSkipped(t *testing.T) {
	d := newDecoder("public", "outbox_events", layout.Relay)
	var m Message
	if err := d.decode(relationMsg(2, "public", "orders", "id", "total"), &m); err != nil {
		t.Fatal(err)
	}
	if err := d.decode(insertMsg(2, "1", "2"), &m); err != nil || m.Kind != KindOther {
		t.Fatalf("other table: %v %v", err, m.Kind)
	}
	for _, typ := range []byte{'Y', 'O', 'U', 'D', 'T', 'M', 'S', 'E', 'c', 'Z'} {
		if err := d.decode([]byte{typ, 1, 2, 3}, &m); err != nil || m.Kind != KindOther {
			t.Errorf("message %q: %v %v", typ, err, m.Kind)
		}
	}
}

func TestDecodeErrors(t *testing.T) {
	d := newDecoder("public", "outbox_events", layout.Relay)
	var m Message
	if err := d.decode(insertMsg(99, "x"), &m); err == nil || !strings.Contains(err.Error(), "before its relation") {
		t.Fatalf("insert before relation: %v", err)
	}
	for _, b := range [][]byte{{}, {'B', 1}, {'C', 0, 1}, {'R', 0, 0}, {'I', 0}} {
		if err := d.decode(b, &m); err == nil {
			t.Errorf("short message %v decoded", b)
		}
	}
	if err := d.decode(relationMsg(4, "public", "outbox_events", outboxCols...), &m); err != nil {
		t.Fatal(err)
	}
	trunc := insertMsg(4, "id", "a", "b", "c", "1", "{}", "{}", "t", "t")
	if err := d.decode(trunc[:len(trunc)-3], &m); err == nil {
		t.Fatal("truncated insert decoded")
	}
}

// FuzzDecode builds a valid Begin, Relation, Insert, Commit sequence from
// the fuzzer's values, with the outbox columns in a fuzzed order among
// columns the relay ignores, and some values NULL or unchanged-TOAST. Every
// value must come back in its field, and the transaction's XID and LSNs
// must too. Every strict prefix of the insert must then fail to decode:
// a cut message may never yield a row. Finally, arbitrary bytes after the
// relation must not panic the decoder.
func FuzzDecode(f *testing.F) {
	// The values of TestDecodeTransaction and TestDecodeRelationChangeMapsByName.
	f.Add(uint64(0), uint32(1<<FieldHeaders), uint32(777), uint64(0x1000), uint64(0x1030), int64(123456789),
		"id-1", "order", "o-1", "Placed", "1", `{"a": 1}`, "", "2026-01-01 00:00:00+00",
		[]byte(wire{}.u8('B').u64(1).u64(2).u32(3)))
	f.Add(uint64(42), uint32(1<<FieldSchemaVersion), uint32(1), uint64(1), uint64(2), int64(0),
		"id", "type", "agg", "evt", "", "{}", `{"tenant": "t1"}`, "",
		[]byte(wire{}.u8('C').u8(0).u64(1).u64(2).u64(3)))
	f.Add(uint64(7), uint32(0), uint32(0xffffffff), uint64(1)<<63, uint64(1)<<63+8, int64(-1),
		"", "", "", "", "", "", "", "", insertMsg(1, "id", "a", "b", "c", "1", "{}", "\x00null", "t", "t"))
	f.Fuzz(func(t *testing.T, order uint64, absent uint32, xid uint32, commitLSN, endLSN uint64, micros int64,
		eventID, aggType, aggID, eventType, schemaVersion, payload, headers, occurredAt string, junk []byte) {
		values := [numFields]string{eventID, aggType, aggID, eventType, schemaVersion, payload, headers, occurredAt}
		d := newDecoder("public", "outbox_events", layout.Relay)
		columnNames, _ := layout.Relay.ColumnIndex()
		var m Message

		// Keep the commit time where time.UnixMicro cannot overflow.
		micros %= 1 << 60
		begin := wire{}.u8('B').u64(commitLSN).u64(uint64(micros)).u32(xid)
		if err := d.decode(begin, &m); err != nil || m.Kind != KindBegin || m.XID != xid || uint64(m.CommitLSN) != commitLSN ||
			m.CommitTime.UnixMicro() != pgEpoch+micros {
			t.Fatalf("begin: %v %+v", err, m)
		}

		cols := shuffledColumns(order)
		if err := d.decode(relationMsg(1, "public", "outbox_events", cols...), &m); err != nil {
			t.Fatalf("relation %q: %v", cols, err)
		}
		ins := wire{}.u8('I').u32(1).u8('N').u16(uint16(len(cols)))
		for _, c := range cols {
			f, ok := columnNames[c]
			switch {
			case !ok:
				ins = ins.text("ignored " + c)
			case absent&(1<<f) == 0:
				ins = ins.text(values[f])
			case absent&(1<<(f+numFields)) == 0:
				ins = ins.u8('n')
			default:
				ins = ins.u8('u')
			}
		}
		if err := d.decode(ins, &m); err != nil || m.Kind != KindRow {
			t.Fatalf("insert %q: %v, kind %v", ins, err, m.Kind)
		}
		for f := range numFields {
			got := m.Row.Values[f]
			if layout.Relay.Column(layout.Field(f)) == "" {
				// A field the layout reads no column for.
				if got != nil {
					t.Fatalf("field %d has no column, decoded as %q", f, got)
				}
				continue
			}
			if absent&(1<<f) != 0 {
				if got != nil {
					t.Fatalf("field %d was NULL, decoded as %q", f, got)
				}
				continue
			}
			if got == nil || string(got) != values[f] {
				t.Fatalf("field %d = %q, encoded %q (columns %q)", f, got, values[f], cols)
			}
		}
		for n := range len(ins) {
			if err := d.decode(ins[:n], &m); err == nil {
				t.Fatalf("insert cut to %d of %d bytes decoded as a %v: %q", n, len(ins), m.Kind, m.Row.Values)
			}
		}

		commit := wire{}.u8('C').u8(0).u64(commitLSN).u64(endLSN).u64(uint64(micros))
		if err := d.decode(commit, &m); err != nil || m.Kind != KindCommit || uint64(m.CommitLSN) != commitLSN || uint64(m.EndLSN) != endLSN {
			t.Fatalf("commit: %v %+v", err, m)
		}

		// Anything may follow; it must only never panic.
		_ = d.decode(junk, &m)
	})
}

// shuffledColumns is the outbox table's columns plus two the relay
// ignores, in an order chosen by seed.
func shuffledColumns(seed uint64) []string {
	cols := append(slices.Clone(outboxCols), "region", "extra_first")
	rng := mrand.New(mrand.NewPCG(seed, 0))
	rng.Shuffle(len(cols), func(i, j int) { cols[i], cols[j] = cols[j], cols[i] })
	return cols
}

func TestConfigValidate(t *testing.T) {
	ok := Config{Config: pg.Config{DSN: "postgres://u@h/db", Table: "public.outbox_events"}, Publication: "p", Slot: "s"}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]Config{
		"--pg-dsn":      {Config: pg.Config{Table: "t"}, Publication: "p", Slot: "s"},
		"--table":       {Config: pg.Config{DSN: ok.DSN, Table: "a.b.c"}, Publication: "p", Slot: "s"},
		"--slot":        {Config: pg.Config{DSN: ok.DSN, Table: "t"}, Publication: "p", Slot: "Bad-Slot"},
		"--publication": {Config: pg.Config{DSN: ok.DSN, Table: "t"}, Slot: "s"},
	} {
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// Issue 24.2: a relation of the outbox table without a required column
// (renamed, then renamed back) failed the decode, at 0/0 since a relation
// message carries no position, and every session failed the same way: the
// slot re-sends that relation with the row. The relation is accepted and
// its rows carry the reason, with the columns they have mapped by name.
func TestDecodeRowOfRelationWithoutRequiredColumn(t *testing.T) {
	d := newDecoder("public", "outbox_events", layout.Relay)
	var m Message
	if err := d.decode(relationMsg(3, "public", "outbox_events", "event_id", "aggregate_type", "agg_id", "event_type", "payload"), &m); err != nil {
		t.Fatalf("outbox relation without aggregate_id: %v", err)
	}
	if err := d.decode(insertMsg(3, "id-1", "order", "a-1", "Placed", "{}"), &m); err != nil || m.Kind != KindRow {
		t.Fatalf("row of that relation: %v %v", err, m.Kind)
	}
	if !strings.Contains(m.Row.Unmapped, `no column "aggregate_id"`) || !strings.Contains(m.Row.Unmapped, "agg_id") {
		t.Errorf("reason %q does not name the missing column and the columns the row had", m.Row.Unmapped)
	}
	if string(m.Row.Values[FieldEventID]) != "id-1" || m.Row.Values[FieldAggregateID] != nil || string(m.Row.Values[FieldPayload]) != "{}" {
		t.Errorf("values not mapped by name: %q", m.Row.Values)
	}
	// The table as it is again: its rows are whole.
	if err := d.decode(relationMsg(3, "public", "outbox_events", outboxCols...), &m); err != nil {
		t.Fatal(err)
	}
	if err := d.decode(insertMsg(3, "id-2", "order", "a-1", "Placed", "1", "{}", "{}", "t", "t"), &m); err != nil || m.Row.Unmapped != "" {
		t.Fatalf("row after the relation was fixed: %v, unmapped %q", err, m.Row.Unmapped)
	}
}

// A Debezium outbox table is read by the layout's column names: id,
// aggregatetype, aggregateid, payload; type goes nowhere the record uses;
// the header columns land in Row.Extra in --header-columns order, NULL as a
// nil value, and a column that is also a field fills both.
func TestDecodeDebeziumLayout(t *testing.T) {
	l, err := layout.New(layout.NameDebezium, [layout.NumColumns]string{}, "tenant,type:eventType,region")
	if err != nil {
		t.Fatal(err)
	}
	d := newDecoder("public", "outbox", l)
	var m Message
	cols := []string{"id", "aggregatetype", "aggregateid", "type", "payload", "timestamp", "tenant", "region"}
	if err := d.decode(relationMsg(1, "public", "outbox", cols...), &m); err != nil {
		t.Fatal(err)
	}
	if err := d.decode(insertMsg(1, "id-1", "order", "o-1", "Placed", "\x00null", "2026-01-01 00:00:00+00", "acme", "\x00null"), &m); err != nil || m.Kind != KindRow {
		t.Fatalf("insert: %v %+v", err, m)
	}
	v := m.Row.Values
	if string(v[FieldEventID]) != "id-1" || string(v[FieldAggregateType]) != "order" || string(v[FieldAggregateID]) != "o-1" ||
		string(v[FieldEventType]) != "Placed" || v[FieldPayload] != nil || v[FieldHeaders] != nil || m.Row.Unmapped != "" {
		t.Fatalf("row %q unmapped %q", v, m.Row.Unmapped)
	}
	if len(m.Row.Extra) != 3 || string(m.Row.Extra[0]) != "acme" || string(m.Row.Extra[1]) != "Placed" || m.Row.Extra[2] != nil {
		t.Fatalf("header columns %q", m.Row.Extra)
	}
	// The next row starts clean: a value never leaks from the row before.
	if err := d.decode(insertMsg(1, "id-2", "order", "o-1", "Placed", "{}", "2026-01-01 00:00:00+00", "\x00null", "eu"), &m); err != nil {
		t.Fatal(err)
	}
	if m.Row.Extra[0] != nil || string(m.Row.Extra[2]) != "eu" || string(m.Row.Values[FieldPayload]) != "{}" {
		t.Fatalf("second row header columns %q", m.Row.Extra)
	}
	// Without aggregateid the row cannot be published; the reason names
	// the layout's columns.
	if err := d.decode(relationMsg(2, "public", "outbox", "id", "aggregatetype", "payload"), &m); err != nil {
		t.Fatal(err)
	}
	if err := d.decode(insertMsg(2, "id-3", "order", "{}"), &m); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(m.Row.Unmapped, `no column "aggregateid"`) || !strings.Contains(m.Row.Unmapped, "needs id, aggregatetype, aggregateid, payload") {
		t.Fatalf("unmapped %q", m.Row.Unmapped)
	}
}

// A bytea payload column marks its rows binary, by the type the Relation
// message gives, so an ALTER TABLE that changes the type changes the rows
// that follow and no other.
func TestDecodeBinaryPayload(t *testing.T) {
	d := newDecoder("public", "outbox_events", layout.Relay)
	var m Message
	relation := func(payloadType uint32) []byte {
		w := wire{}.u8('R').u32(16384).str("public").str("outbox_events").u8('d').u16(uint16(len(outboxCols)))
		for _, c := range outboxCols {
			typ := uint32(25)
			if c == "payload" {
				typ = payloadType
			}
			w = w.u8(0).str(c).u32(typ).u32(0xffffffff)
		}
		return w
	}
	for _, tc := range []struct {
		typ    uint32
		binary bool
	}{{byteaOID, true}, {3802 /* jsonb */, false}} {
		if err := d.decode(relation(tc.typ), &m); err != nil {
			t.Fatal(err)
		}
		if err := d.decode(insertMsg(16384, "id-1", "order", "o-1", "Placed", "1", `\x00ff`, "\x00null", "\x00null", "\x00null"), &m); err != nil {
			t.Fatal(err)
		}
		if m.Row.PayloadBinary != tc.binary || string(m.Row.Values[FieldPayload]) != `\x00ff` {
			t.Errorf("payload type %d: binary %v, payload %q", tc.typ, m.Row.PayloadBinary, m.Row.Values[FieldPayload])
		}
	}
}
