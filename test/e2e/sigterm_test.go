package e2e

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// SIGTERM in the middle of a backlog must leave nothing to re-deliver: the
// relay drains, confirms what Kafka acknowledged, and ends the copy stream
// so the server reads that last status update before the socket closes.
// It pins the bug where 1 stop in 6 lost the final confirmation (the server
// logged "connection reset by peer") and the next start re-sent 2,132
// events after a clean stop.
func TestCleanStopMidBacklogLeavesNothingToRedeliver(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	conn := e.DB.Connect(t)
	const rounds = 6
	midBacklog := 0
	for round := range rounds {
		before := e.ConfirmedFlush()
		if err := e.writeEvents(conn, 1000, 4, 50); err != nil {
			t.Fatal(err)
		}
		end := e.DB.CurrentLSN(t)
		p := e.StartRelay()
		// Stop once the slot moves: part of the backlog is confirmed, and
		// most likely not all of it yet.
		harness.WaitFor(t, time.Minute, "the slot to move", func() bool { return e.ConfirmedFlush() != before })
		if code, err := p.Stop(time.Minute); err != nil || code != 0 {
			t.Fatalf("round %d: relay exited %d (%v) on SIGTERM, want 0:\n%s", round, code, err, p.Output())
		}
		logged := stoppedAt(t, p.Output())
		slot := e.ConfirmedFlush()
		if slot != logged {
			t.Fatalf("round %d: slot confirmed_flush_lsn %s, but the relay logged confirmed_lsn %s on its clean stop", round, slot, logged)
		}
		if !harness.LSNAtMost(end, slot) {
			midBacklog++
		}
	}
	t.Logf("%d of %d stops came before the round's backlog was confirmed", midBacklog, rounds)
	if midBacklog == 0 {
		t.Fatal("no stop came mid-backlog; the test proved nothing")
	}

	p := e.StartRelay()
	records := e.ConsumeAll(2 * time.Minute)
	if dups := harness.Duplicates(records); len(dups) > 0 {
		t.Fatalf("%d events delivered more than once after only clean stops, e.g. %v", len(dups), firstKeys(dups, 5))
	}
	if code, err := p.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("relay exited %d (%v) on SIGTERM, want 0", code, err)
	}
}

// stoppedAt returns the confirmed_lsn of the relay's "stopped cleanly" log
// line.
func stoppedAt(t *testing.T, out string) string {
	t.Helper()
	for _, line := range strings.Split(out, "\n") {
		var l struct {
			Message      string `json:"message"`
			ConfirmedLSN string `json:"confirmed_lsn"`
		}
		if json.Unmarshal([]byte(line), &l) == nil && l.Message == "stopped cleanly" {
			return l.ConfirmedLSN
		}
	}
	t.Fatalf("no \"stopped cleanly\" line in the relay's output:\n%s", out)
	return ""
}

func firstKeys(m map[string]int, n int) []string {
	var out []string
	for k := range m {
		if len(out) == n {
			break
		}
		out = append(out, k)
	}
	return out
}
