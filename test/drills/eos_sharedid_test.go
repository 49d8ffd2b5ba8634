package drills

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// msgSharedID is what a relay logs when it is fenced again with no relay
// of its own slot in between: another slot uses its transactional id.
const msgSharedID = "a relay of another slot or database uses the same transactional id"

// TestDrillEOSSharedTransactionalID gives two exactly-once relays on
// different slots (each with its own topics) the same --transactional-id,
// a misconfiguration: each start fences the other, so they take turns. It
// must stay safe (every fenced Kafka transaction aborts, and each relay
// re-streams from its own slot's progress, so read_committed readers see
// every event once on each relay's topics) and the log must name the
// cause and the fix. With the fix applied, both settle.
func TestDrillEOSSharedTransactionalID(t *testing.T) {
	rng := newRand(t)
	a, k := newKfakeWorld(t, shared)
	envB := *a.Env
	envB.Slot = a.Slot + "_b"
	b := &world{Env: &envB, pg: a.pg, topicPrefix: "outbox.other.", relayDSN: a.relayDSN, types: a.types}
	for _, topic := range b.topics() {
		k.CreateTopic(t, topic, partitions, nil)
	}
	harness.Migrate(t, b.Bin, harness.RelayFlags{DSN: b.DB.DSN(), Slot: b.Slot}.Args("migrate", "--slot-only"))
	b.DB.DropSlotAtEnd(t, b.Slot)

	sharedID := append([]string{"--transactional-id", "outbox-relay:shared"}, eosFlags...)
	relayA := a.startRelay(sharedID...)
	relayB := b.startRelay(sharedID...)
	conn := a.connect()
	pw := startPacedWriter(a, conn, writerRand(rng), 5*time.Millisecond, 5, 100, false)
	defer pw.halt()
	harness.WaitFor(t, 2*time.Minute, "both relays log the shared transactional id", func() bool {
		return relayA.Exited() || relayB.Exited() ||
			strings.Contains(relayA.Output(), msgSharedID) && strings.Contains(relayB.Output(), msgSharedID)
	})
	if relayA.Exited() || relayB.Exited() {
		t.Fatalf("a relay exited: A\n%s\nB\n%s", relayA.Output(), relayB.Output())
	}
	if err := pw.halt(); err != nil {
		t.Fatalf("writer: %v", err)
	}
	t.Logf("with a shared id: %d events committed; A fenced %d times, B %d times", a.CommittedCount(),
		strings.Count(relayA.Output(), "fenced"), strings.Count(relayB.Output(), "fenced"))
	t.Logf("relay A logged: %s", checkLogLine(t, relayA.Output(), msgSharedID, "--transactional-id"))

	// The fix the log gives: B gets its own id (the default). Then each
	// relay's topics hold every event exactly once.
	relayB.Kill()
	relayB = b.startRelay(eosFlags...)
	recA := a.settleExactlyOnce(3 * time.Minute)
	eventsA := a.CommittedCount()
	recB := b.settleExactlyOnce(3 * time.Minute)
	if relayA.Exited() || relayB.Exited() {
		t.Fatalf("a relay exited: A\n%s\nB\n%s", relayA.Output(), relayB.Output())
	}
	t.Logf("read_committed: %d records for %d events on A's topics, %d for %d on B's (0 missing, 0 duplicates)",
		len(recA), eventsA, len(recB), b.CommittedCount())
}

// checkLogLine fails unless a JSON log line holding msg also holds each of
// want, and is logged at level error; it returns the line.
func checkLogLine(t *testing.T, out, msg string, want ...string) string {
	t.Helper()
	for _, line := range strings.Split(out, "\n") {
		if !strings.Contains(line, msg) {
			continue
		}
		for _, w := range append(want, `"level":"error"`) {
			if !strings.Contains(line, w) {
				t.Errorf("log line lacks %q: %s", w, line)
			}
		}
		return line
	}
	t.Errorf("no log line with %q", msg)
	return ""
}
