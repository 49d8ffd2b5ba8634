package drills

import (
	"crypto/rand"
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// haltArgs makes the relay stop on a permanent error instead of
// quarantining the event (the default) and going on: the mode these drills
// pin.
var haltArgs = []string{"--on-permanent-error", "halt"}

// incompressible returns n hex characters of random bytes: lz4 (the
// relay's default compression) cannot shrink it below the topic's limit.
func incompressible(n int) string {
	b := make([]byte, (n+1)/2)
	rand.Read(b)
	return hex.EncodeToString(b)[:n]
}

// TestDrillPermanentRejection: Kafka will never accept some events as they
// are. The relay must stop (with --on-permanent-error halt) with a message
// naming the event_id, the topic and the reason, exit non-zero, deliver the
// events before it, and never confirm the slot past it, so nothing is lost
// once the operator fixes the cause. Sent anyway, an oversize record fails
// its whole batch and takes its neighbours' order down with it.
func TestDrillPermanentRejection(t *testing.T) {
	// (a) A record larger than the topic's max.message.bytes (2000).
	t.Run("MessageTooLarge", func(t *testing.T) {
		w := newWorld(t, shared, nil)
		k := harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: partitions})
		w.Brokers = k.Brokers()
		k.CreateTopic(t, w.topicPrefix+"order", partitions, map[string]string{"max.message.bytes": "2000"})
		for _, topic := range w.topics()[1:] {
			k.CreateTopic(t, topic, partitions, nil)
		}
		big := harness.OutboxEvent{AggregateType: "order", AggregateID: "agg-big", EventType: "Huge",
			Payload: `{"blob": "` + incompressible(4000) + `"}`}
		rejectionDrill(t, w, big, "outbox.event.order", []string{"too large", "max.message.bytes"})
	})
	// (b) A topic that does not exist, with auto-creation off.
	t.Run("UnknownTopic", func(t *testing.T) {
		w := newWorld(t, shared, nil)
		k := startKfake(t, harness.KfakeOptions{DisableAutoCreate: true}, w.topics())
		w.Brokers = k.Brokers()
		ghost := harness.OutboxEvent{AggregateType: "ghost", AggregateID: "agg-ghost", EventType: "Boo", Payload: `{"boo": 1}`}
		rejectionDrill(t, w, ghost, "outbox.event.ghost", []string{"does not exist"})
	})
}

func rejectionDrill(t *testing.T, w *world, bad harness.OutboxEvent, topic string, reason []string) {
	rng := newRand(t)
	w.Migrate()
	conn := w.connect()
	relay := w.startRelay(haltArgs...)
	if err := w.writeTxns(conn, rng, 10, 5, 30); err != nil {
		t.Fatal(err)
	}
	before, _ := w.Committed()
	fence := w.fence(conn, []harness.OutboxEvent{bad})
	ids, _ := w.Committed()
	badID := ids[len(ids)-1]
	if err := w.writeTxns(conn, rng, 5, 5, 30); err != nil {
		t.Fatal(err)
	}
	all, _ := w.Committed()
	after := all[len(before)+1:]

	code, err := relay.Wait(2 * time.Minute)
	if err != nil {
		t.Fatalf("relay still running 2 minutes after a permanently rejected event: %v", err)
	}
	out := relay.Output()
	if code == 0 {
		t.Errorf("relay exited 0 after a permanently rejected event; want non-zero")
	}
	var failure string
	for _, l := range harness.LogLines(out) {
		if l.Str("level") == "error" && strings.Contains(l.Str("message"), badID) {
			failure = l.Str("message")
		}
	}
	if failure == "" {
		t.Fatalf("no error line names event %s; output:\n%s", badID, out)
	}
	for _, want := range append([]string{badID, topic}, reason...) {
		if !strings.Contains(failure, want) {
			t.Errorf("the failure does not say %q: %s", want, failure)
		}
	}
	if c := w.ConfirmedFlush(); !notPast(c, fence) {
		t.Errorf("confirmed_flush_lsn %s passed the rejected event (commit at %s)", c, fence)
	}
	records := harness.ConsumeEventIDs(t, w.Brokers, w.topicRegex(), before, time.Minute)
	got := map[string]bool{}
	for _, r := range records {
		got[r.EventID()] = true
	}
	if got[badID] {
		t.Errorf("the rejected event %s is in Kafka", badID)
	}
	late := 0
	for _, id := range after {
		if got[id] {
			late++
		}
	}
	if late > 0 {
		t.Errorf("%d events committed after the rejected one were published though the relay halted on it", late)
	}
	t.Logf("exit %d: %s", code, failure)
}
