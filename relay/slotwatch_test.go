package relay

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/replication"
)

// The poller says once, loudly, that the slot's WAL is at risk, says it
// again when it gets worse (lost), and once when it recovers; the
// wal_status gauge is one-hot.
func TestSlotPollerWarnsOnceWhenWALIsAtRisk(t *testing.T) {
	var logs bytes.Buffer
	r := New(DefaultConfig(), zerolog.New(&logs), nil, Hooks{})
	p := r.newSlotWatch()
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

// Outside the stream the age of the oldest unpublished event comes from
// the slot's position (issue 30: it stayed 0 through a Kafka outage). A
// reading's moment counts as caught up only once the slot confirmed the
// WAL end that reading found; while the relay reads the stream, the age is
// that of the events in flight.
func TestUnpublishedAgeFromTheSlotPosition(t *testing.T) {
	r := New(DefaultConfig(), zerolog.Nop(), nil, Hooks{})
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	p := r.newSlotWatch()
	p.started = t0
	r.slot.watching(t0)
	reading := func(at time.Duration, confirmed, end lsn.LSN) {
		c := confirmed.String()
		p.notePosition(&replication.SlotInfo{Name: "s", ConfirmedFlushLSN: &c, CurrentLSN: end.String()}, t0.Add(at))
	}
	age := func(at time.Duration) float64 {
		_, a := r.streamState(t0.Add(at))
		return a
	}
	r.setState(pipeline.StateBackingOff, nil)

	reading(0, 100, 100) // caught up at t0+0
	if got := age(3 * time.Second); got != 0 {
		t.Errorf("slot caught up: age %v, want 0", got)
	}
	reading(5*time.Second, 100, 200) // behind: events may be committed from t0+0 on
	reading(10*time.Second, 150, 300)
	if got := age(20 * time.Second); got != 20 {
		t.Errorf("slot behind since the reading at 0 s: age at 20 s = %v, want 20", got)
	}
	reading(15*time.Second, 200, 300) // confirmed the end read at 5 s
	if got := age(20 * time.Second); got != 15 {
		t.Errorf("slot confirmed what the 5 s reading found: age at 20 s = %v, want 15", got)
	}
	// Streaming with nothing in flight: the relay reads every event at once.
	r.setStreaming(lsn.NewTracker(0, lsn.Limits{Events: 10}))
	if got := age(20 * time.Second); got != 0 {
		t.Errorf("streaming, nothing in flight: age %v, want 0", got)
	}
	r.report.pause(time.Now(), errors.New("kafka: client has run out of available brokers to talk to"))
	if got := age(20 * time.Second); got != 15 {
		t.Errorf("waiting for Kafka: age %v, want 15", got)
	}
}

// Issue 40.11: during a Kafka outage /slot said "streaming" with an older
// last_error while /readyz said 503. Both now come from one status: the
// wait for Kafka, with its cause and when it began.
func TestWaitingForKafkaIsOneTruth(t *testing.T) {
	r := New(DefaultConfig(), zerolog.Nop(), nil, Hooks{})
	r.setStreaming(lsn.NewTracker(0, lsn.Limits{Events: 10}))
	r.mu.Lock()
	r.status.SetError("an error from an hour ago", time.Now().Add(-time.Hour))
	r.mu.Unlock()
	if ok, why := r.Ready(); !ok {
		t.Fatalf("streaming relay not ready: %s", why)
	}
	pausedAt := time.Now()
	r.report.pause(pausedAt, errors.New("kafka: client has run out of available brokers to talk to"))
	s := r.Status()
	if s.State != pipeline.StateWaitingForKafka || !s.Since.Equal(pausedAt) {
		t.Errorf("/slot state %s since %v, want %s since the pause", s.State, s.Since, pipeline.StateWaitingForKafka)
	}
	if !strings.Contains(s.LastError, "run out of available brokers") || s.LastErrorAt == nil || !s.LastErrorAt.Equal(pausedAt) {
		t.Errorf("/slot last_error %q at %v, want the Kafka failure at the pause", s.LastError, s.LastErrorAt)
	}
	ok, why := r.Ready()
	if ok || !strings.Contains(why, string(pipeline.StateWaitingForKafka)) || !strings.Contains(why, "run out of available brokers") {
		t.Errorf("/readyz ready %v (%s), want not ready for the same reason /slot gives", ok, why)
	}
	r.report.start()
	if ok, why := r.Ready(); !ok {
		t.Errorf("streaming again, yet not ready: %s", why)
	}
}
