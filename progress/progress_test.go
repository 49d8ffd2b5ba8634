package progress

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// TestRecordFormat pins the record's JSON, which the exactly-once mode and
// operators' tools read too.
func TestRecordFormat(t *testing.T) {
	r := Record{LSN: 0x16B3748, Timeline: 1, CommitTime: time.Date(2026, 12, 1, 3, 0, 0, 123456000, time.FixedZone("x", 3600)), RelayVersion: "1.4.0"}
	got := string(r.Marshal())
	want := `{"version":1,"lsn":"0/16B3748","timeline":1,"commit_time":"2026-12-01T02:00:00.123456Z","relay_version":"1.4.0"}`
	if got != want {
		t.Fatalf("Marshal:\n got %s\nwant %s", got, want)
	}
	back, err := Unmarshal([]byte(got))
	if err != nil {
		t.Fatal(err)
	}
	if back.LSN != r.LSN || back.Timeline != 1 || !back.CommitTime.Equal(r.CommitTime) || back.RelayVersion != "1.4.0" {
		t.Fatalf("round trip: %+v", back)
	}
	eos := Record{LSN: 0x16B3748, Timeline: 1, RelayVersion: "1.5.0", Delivery: "exactly-once"}
	if got := string(eos.Marshal()); got != `{"version":1,"lsn":"0/16B3748","timeline":1,"relay_version":"1.5.0","delivery":"exactly-once"}` {
		t.Fatalf("record with its delivery mode: %s", got)
	}
	if back, err := Unmarshal(eos.Marshal()); err != nil || back.Delivery != "exactly-once" {
		t.Fatalf("round trip of the delivery mode: %+v, %v", back, err)
	}
	idle := Record{LSN: 0x1_0000_0010, Timeline: 2}
	if got := string(idle.Marshal()); got != `{"version":1,"lsn":"1/10","timeline":2,"relay_version":""}` {
		t.Fatalf("record without commit time: %s", got)
	}
	if string(Key("outbox_relay", "7312345678901234567")) != "outbox_relay@7312345678901234567" {
		t.Fatalf("key: %s", Key("outbox_relay", "7312345678901234567"))
	}
}

// TestRecoveryMark pins the mark a recovery of a lost slot leaves in the
// record until it finishes; records without it read as before.
func TestRecoveryMark(t *testing.T) {
	since := time.Date(2026, 12, 3, 10, 0, 0, 5000, time.UTC)
	r := Record{LSN: 0x10, Timeline: 2, CommitTime: since.Add(time.Hour), RecoverySince: since}
	got := string(r.Marshal())
	want := `{"version":1,"lsn":"0/10","timeline":2,"commit_time":"2026-12-03T11:00:00.000005Z","relay_version":"","recovery_since":"2026-12-03T10:00:00.000005Z"}`
	if got != want {
		t.Fatalf("Marshal:\n got %s\nwant %s", got, want)
	}
	back, err := Unmarshal([]byte(got))
	if err != nil {
		t.Fatal(err)
	}
	if !back.RecoverySince.Equal(since) || !back.CommitTime.Equal(r.CommitTime) || back.LSN != r.LSN {
		t.Fatalf("round trip: %+v", back)
	}
	plain, err := Unmarshal([]byte(`{"version":1,"lsn":"0/10","timeline":2,"relay_version":""}`))
	if err != nil || !plain.RecoverySince.IsZero() {
		t.Fatalf("a record without the mark: %+v, %v", plain, err)
	}
}

func TestUnmarshalRejects(t *testing.T) {
	for name, value := range map[string]string{
		"newer version":   `{"version":2,"lsn":"0/1","timeline":1}`,
		"no version":      `{"lsn":"0/1","timeline":1}`,
		"bad lsn":         `{"version":1,"lsn":"16B3748","timeline":1}`,
		"no timeline":     `{"version":1,"lsn":"0/1"}`,
		"bad commit time": `{"version":1,"lsn":"0/1","timeline":1,"commit_time":"yesterday"}`,
		"bad recovery":    `{"version":1,"lsn":"0/1","timeline":1,"recovery_since":"soon"}`,
		"not json":        `0/16B3748`,
	} {
		if r, err := Unmarshal([]byte(value)); err == nil {
			t.Errorf("%s: %s decoded as %+v", name, value, r)
		}
	}
	_, err := Unmarshal([]byte(`{"version":2,"lsn":"0/1","timeline":1}`))
	if !errors.Is(err, ErrUnknownVersion) || !strings.Contains(err.Error(), "--reset-progress") {
		t.Fatalf("a newer version must say so and what to do: %v", err)
	}
}

// BenchmarkOffer is the read loop's whole cost of progress per status
// update: it must stay far below the per-event cost of publishing.
func BenchmarkOffer(b *testing.B) {
	w := &Writer{wake: make(chan struct{}, 1)}
	key := Key("outbox_relay", "7312345678901234567")
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		w.Offer(key, Record{LSN: lsn.LSN(i), Timeline: 1})
	}
}
