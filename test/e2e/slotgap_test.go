package e2e

import (
	"encoding/json"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// A slot created while a progress record says Kafka holds the stream only
// up to an earlier position (the slot was dropped while no relay ran, or a
// failover reached a server the slot was not synced to): the events
// committed in between are never streamed. A relay told to make the slot
// anyway (--existing-rows published) must say so, with
// the window and the reconcile command that finds them, and that command
// must find exactly them.
func TestSlotCreatedAfterProgressNamesTheGap(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	p := e.StartRelay()
	conn := e.DB.Connect(t)
	if err := e.writeEvents(conn, 2, 1, 1); err != nil {
		t.Fatal(err)
	}
	e.ConsumeAll(30 * time.Second)
	// A clean stop writes the last acknowledged position to the progress
	// topic.
	if code, err := p.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("relay exited %d (%v):\n%s", code, err, p.Output())
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND active", e.Slot); n != 0 {
		t.Fatal("the slot is still active after the relay exited")
	}
	e.DB.Exec(t, "SELECT pg_drop_replication_slot($1)", e.Slot)

	// Committed while no slot exists: no slot will ever stream these.
	gapStart := e.CommittedCount()
	if err := e.writeEvents(conn, 3, 1, 1); err != nil {
		t.Fatal(err)
	}
	ids, _ := e.Committed()
	gap := ids[gapStart:]

	// Issue 51: the relay no longer makes the slot over the gap by
	// itself; it stops and asks. --existing-rows published is the choice
	// that gives the gap up, and it must still name it.
	refused := e.StartRelayNoWait()
	if code, err := refused.Wait(time.Minute); err != nil || code != 1 || !strings.Contains(refused.Output(), "--existing-rows pending") {
		t.Fatalf("a slot missing while Kafka holds progress: exit %d (%v), want 1 naming the choices:\n%s", code, err, harness.LastLines(refused.Output(), 5))
	}
	p = e.StartRelay("--existing-rows", "published")
	p.WaitForOutput(t, "the slot was created now, after the position Kafka holds", 30*time.Second)
	var line harness.LogLine
	for _, l := range harness.LogLines(p.Output()) {
		if strings.HasPrefix(l.Str("message"), "the slot was created now") {
			line = l
		}
	}
	reconcileCmd := line.Str("reconcile_command")
	if line.Str("level") != "error" || line.Str("gap_from_lsn") == "" || line.Str("gap_to_lsn") == "" || reconcileCmd == "" {
		t.Fatalf("the gap line lacks its level, window or reconcile command: %v", line)
	}
	window := regexp.MustCompile(`--since (\S+) --until (\S+)`).FindStringSubmatch(reconcileCmd)
	if window == nil {
		t.Fatalf("no window in the reconcile command %q", reconcileCmd)
	}

	code, out := harness.RunCommand(t, e.Bin, e.Args("reconcile", "--kafka-brokers", e.Kafka.BrokerList(), "--json", "--since", window[1], "--until", window[2]), "OUTBOX_RELAY_LOG_LEVEL=warn")
	var rep struct {
		Missing []string `json:"missing"`
	}
	start := strings.Index(out, "{\n")
	if start < 0 || json.NewDecoder(strings.NewReader(out[start:])).Decode(&rep) != nil {
		t.Fatalf("reconcile exited %d with no JSON report:\n%s", code, out)
	}
	slices.Sort(rep.Missing)
	slices.Sort(gap)
	if code != 3 || !slices.Equal(rep.Missing, gap) {
		t.Fatalf("reconcile over the named window: exit %d, missing %v; want exit 3 and the %d events committed without a slot %v", code, rep.Missing, len(gap), gap)
	}

	// The same, seen by an independent client: events committed after the
	// new slot arrive, the gap's never do. Every event has the same
	// aggregate, so one partition holds them all in commit order, and a
	// gap event sent at all would come before the later ones.
	gapEnd := e.CommittedCount()
	if err := e.writeEvents(conn, 2, 1, 1); err != nil {
		t.Fatal(err)
	}
	ids, _ = e.Committed()
	delivered := append(slices.Clone(ids[:gapStart]), ids[gapEnd:]...)
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, delivered, 30*time.Second)
	for _, r := range records {
		if slices.Contains(gap, r.EventID()) {
			t.Errorf("event %s, committed while no slot existed, reached Kafka", r.EventID())
		}
	}
}
