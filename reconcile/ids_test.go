package reconcile

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/internal/kafkaread"
)

func TestParseEventID(t *testing.T) {
	for _, tc := range []struct {
		in string
		ok bool
	}{
		{"0191f7a2-7c3e-4b8a-9d21-5f0e6c4b2a10", true},
		{"0191F7A2-7C3E-4B8A-9D21-5F0E6C4B2A10", true},
		{"0191f7a27c3e4b8a9d215f0e6c4b2a10", false},     // no dashes: not PostgreSQL's text form
		{"0191f7a2-7c3e-4b8a-9d21-5f0e6c4b2a1", false},  // short
		{"0191f7a2-7c3e-4b8a-9d21-5f0e6c4b2a1g", false}, // not hex
		{"0191f7a2_7c3e-4b8a-9d21-5f0e6c4b2a10", false},
		{"order-17", false},
		{"", false},
	} {
		id, ok := ParseEventID([]byte(tc.in))
		if ok != tc.ok {
			t.Errorf("ParseEventID(%q) ok = %v, want %v", tc.in, ok, tc.ok)
			continue
		}
		if ok && id.String() != "0191f7a2-7c3e-4b8a-9d21-5f0e6c4b2a10" {
			t.Errorf("ParseEventID(%q) = %s, want the lower-case form", tc.in, id)
		}
	}
}

func mustID(t *testing.T, s string) EventID {
	t.Helper()
	id, ok := ParseEventID([]byte(s))
	if !ok {
		t.Fatalf("bad test id %q", s)
	}
	return id
}

// Duplicate rows (a text id column without a key) count once, and every
// record of a row is counted, whatever order the rows came in.
func TestRowSetCountsRecords(t *testing.T) {
	a := mustID(t, "ffffffff-0000-4000-8000-000000000001")
	b := mustID(t, "00000000-0000-4000-8000-000000000002")
	c := mustID(t, "80000000-0000-4000-8000-000000000003")
	s := &rowSet{}
	for _, id := range []EventID{a, b, c, a} {
		s.add(id)
	}
	s.seal()
	if len(s.ids) != 3 {
		t.Fatalf("%d ids after seal, want 3", len(s.ids))
	}
	for _, id := range []EventID{a, a, c} {
		if !s.mark(id) {
			t.Fatalf("mark(%s) = false for a row", id)
		}
	}
	if s.mark(mustID(t, "11111111-0000-4000-8000-000000000004")) {
		t.Fatalf("mark of an id with no row = true")
	}
	want := map[EventID]uint32{a: 2, b: 0, c: 1}
	for i, id := range s.ids {
		if got := s.counts[i].Load(); got != want[id] {
			t.Errorf("count of %s = %d, want %d", id, got, want[id])
		}
	}
}

// A record counts as a phantom candidate only inside the phantom window
// and only when no window row has its id; records without a uuid are
// counted apart, and only inside the window.
func TestPartitionReaderSortsRecords(t *testing.T) {
	row := mustID(t, "00000000-0000-4000-8000-00000000000a")
	stranger := mustID(t, "00000000-0000-4000-8000-00000000000b")
	rows := &rowSet{}
	rows.add(row)
	rows.seal()
	since := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	until := since.Add(time.Hour)
	var done atomic.Int64
	p := &partitionReader{r: partitionRange{topic: "t", partition: 2}, rows: rows, phantomSince: since, until: until, done: &done}
	msg := func(id string, at time.Time) *kafkaread.Record {
		m := &kafkaread.Record{Timestamp: at}
		if id != "" {
			m.Headers = []*sarama.RecordHeader{{Key: []byte("other"), Value: []byte("x")}, {Key: []byte("event_id"), Value: []byte(id)}}
		}
		return m
	}
	for i, m := range []*kafkaread.Record{
		msg(row.String(), since.Add(-time.Minute)),      // a row's record, before the window: still counts
		msg(stranger.String(), since.Add(time.Minute)),  // phantom
		msg(stranger.String(), since.Add(-time.Second)), // before the window: not a phantom
		msg(stranger.String(), until),                   // at until: outside
		msg("", since.Add(time.Minute)),                 // no header
		msg("order-1", since.Add(time.Minute)),          // not a uuid
		msg("order-1", until.Add(time.Minute)),          // not a uuid, outside
	} {
		m.Offset = int64(i)
		p.record(*m)
	}
	if rows.counts[0].Load() != 1 {
		t.Errorf("the row's record was not counted")
	}
	if len(p.candidates) != 1 || p.candidates[0].EventID != stranger || p.candidates[0].Offset != 1 {
		t.Errorf("candidates %+v, want only offset 1", p.candidates)
	}
	if p.unidentified != 2 || p.records != 7 {
		t.Errorf("unidentified %d records %d, want 2 and 7", p.unidentified, p.records)
	}
}

// Reconcile finds the event id where the record format puts it: the ce_id
// header in binary CloudEvents, the value's id in structured ones. Read
// from the wrong place every record would look missing, and --republish
// would send the whole window again.
func TestPartitionReaderFindsCloudEventIDs(t *testing.T) {
	id := mustID(t, "00000000-0000-4000-8000-00000000000c")
	for _, tc := range []struct {
		name      string
		idHeader  string
		idInValue bool
		msg       kafkaread.Record
	}{
		{"binary", "ce_id", false, kafkaread.Record{Value: []byte(`{"a":1}`),
			Headers: []*sarama.RecordHeader{{Key: []byte("ce_specversion"), Value: []byte("1.0")}, {Key: []byte("ce_id"), Value: []byte(id.String())}}}},
		{"structured", "", true, kafkaread.Record{Value: []byte(`{"specversion":"1.0","id":"` + id.String() + `","source":"/s","type":"T","data":{"id":"not this"}}`),
			Headers: []*sarama.RecordHeader{{Key: []byte("content-type"), Value: []byte("application/cloudevents+json")}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rows := &rowSet{}
			rows.add(id)
			rows.seal()
			var done atomic.Int64
			p := &partitionReader{rows: rows, done: &done, idHeader: tc.idHeader, idInValue: tc.idInValue}
			p.record(tc.msg)
			if rows.counts[0].Load() != 1 || p.unidentified != 0 {
				t.Errorf("the row's record was not found (unidentified %d)", p.unidentified)
			}
		})
	}
}
