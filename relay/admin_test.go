package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/engine"
	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// /slot once opened a PostgreSQL connection per request. It now serves the
// slot watch's reading and says how old it is. The DSN points at a port
// nothing listens on: a handler that connected would report that failure.
func TestSlotServesThePollersReading(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Replication.DSN = "postgres://relay@127.0.0.1:1/app?connect_timeout=1"
	r := New(cfg, zerolog.Nop(), nil, Hooks{})
	handler := r.AdminHandler(nil)
	get := func() SlotReport {
		t.Helper()
		rec := httptest.NewRecorder()
		handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/slot", nil))
		if rec.Code != http.StatusOK {
			t.Fatalf("/slot: %d %s", rec.Code, rec.Body)
		}
		var report SlotReport
		if err := json.Unmarshal(rec.Body.Bytes(), &report); err != nil {
			t.Fatalf("/slot: %v\n%s", err, rec.Body)
		}
		return report
	}

	before := get()
	if before.Slot != nil || before.SlotReadAt != nil || !strings.Contains(before.SlotError, "not been read yet") {
		t.Fatalf("before the first reading: %+v", before)
	}

	readAt := time.Now().Add(-3 * time.Second)
	watch := r.newSlotWatch()
	watch.noteReading(&replication.SlotInfo{Name: "outbox_relay", Plugin: "pgoutput", Active: true}, true, nil, readAt, nil)
	watch.view.noteQuarantined(7)
	report := get()
	if report.SlotError != "" || report.Slot == nil || report.Slot.Name != "outbox_relay" || !report.Slot.Active {
		t.Fatalf("after a reading: %+v", report)
	}
	if report.SlotReadAt == nil || !report.SlotReadAt.Equal(readAt) {
		t.Errorf("slot_read_at %v, want %v", report.SlotReadAt, readAt)
	}
	if age := report.SlotAgeSeconds; age == nil || *age < 3 || *age > 60 {
		t.Errorf("slot_reading_age_seconds %v, want about 3", age)
	}
	if report.Relay == nil || report.Relay.QuarantinedEvents != 7 {
		t.Errorf("relay status %+v, want the poller's quarantine count", report.Relay)
	}

	watch.noteReading(nil, false, nil, time.Now(), nil)
	if missing := get(); missing.Slot != nil || !strings.Contains(missing.SlotError, "does not exist") {
		t.Errorf("a missing slot: %+v", missing)
	}
}

// Status keeps what it reports itself: the last ack comes from the
// session's outcomes, not from reading the metrics back.
func TestStatusLastAckComesFromOutcomes(t *testing.T) {
	r := New(DefaultConfig(), zerolog.Nop(), nil, Hooks{})
	if r.Status().LastAck != nil {
		t.Fatal("a last ack before any ack")
	}
	tracker := lsn.NewTracker(1, lsn.Limits{Events: 10, Bytes: 1 << 20})
	txn := tracker.Open(time.Now())
	tracker.Add(txn, 10)
	s := &walReader{loopEnv: r.loopEnv(), tracker: tracker}
	before := time.Now()
	if err := s.Settle(uint64(txn), engine.Fate{Acked: true, Bytes: 10, Delivery: sink.Delivery{Txn: uint64(txn), Bytes: 10, Topic: "t", At: time.Now()}}); err != nil {
		t.Fatal(err)
	}
	if last := r.Status().LastAck; last == nil || last.Before(before) {
		t.Fatalf("last ack %v after an ack at %v", last, before)
	}
}

// Issue 11.9: `quarantine replay` skipped the row checks, and an event
// quarantined for a NULL aggregate_id replayed with the key "". Replay
// refuses it like the engine, before anything is sent (a nil store would
// panic if replay tried to remove it from quarantine).
func TestReplayChecksRowsLikeTheReadLoop(t *testing.T) {
	kafka := harness.StartKfake(t)
	cfg := publisher.DefaultConfig()
	cfg.Brokers = kafka.Brokers()
	events := []Quarantined{
		{Stored: event.Stored{EventID: harness.NewUUID(), AggregateType: "order", AggregateID: "", EventType: "created", Payload: "{}"}},
		{Stored: event.Stored{EventID: harness.NewUUID(), AggregateType: "", AggregateID: "1", EventType: "created", Payload: "{}"}},
	}
	results, err := Replay(context.Background(), publisher.NewKafka(cfg, zerolog.Nop()), layout.Relay, nil, events, 10*time.Second, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"aggregate_id", "aggregate_type"} {
		if results[i].Err == nil || !strings.Contains(results[i].Err.Error(), "NULL or empty "+want) {
			t.Errorf("event %d: %v, want refused for its %s", i, results[i].Err, want)
		}
	}
}

// Issue 24.15: /readyz kept "slot in use by PID ..." as its reason after
// that process had gone and the relay was connecting again.
func TestReadyReasonDropsAnErrorTheRelayMovedPast(t *testing.T) {
	r := New(DefaultConfig(), zerolog.Nop(), nil, Hooks{})
	busy := fmt.Errorf("%w: replication slot \"s\" is active for PID 4242", replication.ErrSlotBusy)
	r.setState(pipeline.StateWaitingForSlot, busy)
	if ready, reason := r.Ready(); ready || !strings.Contains(reason, "PID 4242") {
		t.Fatalf("waiting for the slot: %v %q", ready, reason)
	}
	r.setState(pipeline.StateConnecting, nil)
	if ready, reason := r.Ready(); ready || reason != string(pipeline.StateConnecting) {
		t.Errorf("connecting after the holder left: %v %q, want %q alone", ready, reason, pipeline.StateConnecting)
	}
	if st := r.Status(); st.LastError == "" {
		t.Error("/slot lost last_error")
	}
	// Any other error still explains a relay that is connecting again.
	r.setState(pipeline.StateBackingOff, fmt.Errorf("connect: dial tcp 127.0.0.1:1: connection refused"))
	r.setState(pipeline.StateConnecting, nil)
	if _, reason := r.Ready(); !strings.Contains(reason, "connection refused") {
		t.Errorf("connecting after a failure: %q, want the failure", reason)
	}
}
