package relay

import (
	"bytes"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/replication"
)

// The poller says once, loudly, that the slot's WAL is at risk, says it
// again when it gets worse (lost), and once when it recovers; the
// wal_status gauge is one-hot.
func TestSlotPollerWarnsOnceWhenWALIsAtRisk(t *testing.T) {
	var logs bytes.Buffer
	r := New(DefaultConfig(), zerolog.New(&logs), nil, Hooks{})
	p := &slotPoller{relay: r}
	safe := int64(-1024)
	for _, status := range []string{"reserved", "extended", "unreserved", "unreserved", "lost", "lost", "reserved"} {
		s := status
		p.noteWALStatus(&replication.SlotInfo{Name: "s", WALStatus: &s, SafeWALSize: &safe}, status)
		r.metrics.setWALStatus(status)
		for _, w := range walStatuses {
			want := 0.0
			if w == status {
				want = 1
			}
			var m dto.Metric
			if err := r.metrics.SlotWALStatus.WithLabelValues(w).Write(&m); err != nil {
				t.Fatal(err)
			}
			if got := m.GetGauge().GetValue(); got != want {
				t.Errorf("after %s: outbox_relay_slot_wal_status{wal_status=%q} = %v, want %v", status, w, got, want)
			}
		}
	}
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("want 3 log lines (unreserved, lost, recovered), got %d:\n%s", len(lines), logs.String())
	}
	for i, want := range [][2]string{{"error", "unreserved"}, {"error", "lost"}, {"info", "reserved"}} {
		if !strings.Contains(lines[i], `"level":"`+want[0]+`"`) || !strings.Contains(lines[i], `"wal_status":"`+want[1]+`"`) {
			t.Errorf("log line %d %s: want level %s, wal_status %s", i, lines[i], want[0], want[1])
		}
	}
	if !strings.Contains(lines[1], "invalidated") || !strings.Contains(lines[0], "safe_wal_size") {
		t.Errorf("the warnings do not explain themselves:\n%s", logs.String())
	}
}
