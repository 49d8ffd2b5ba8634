package e2e

import (
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Issue 24.14: migrate said "schema is up to date" after creating
// everything, and the streaming line's status_every was the keepalive
// interval, not --status-interval. migrate now names what it created, and
// the streaming line gives both intervals under their own names.
func TestMigrateAndStreamingLinesSayWhatHappened(t *testing.T) {
	e := newEnv(t)
	code, out := harness.RunCommand(t, e.Bin, e.Args("migrate"), harness.LogLevelInfo)
	if code != 0 || !strings.Contains(out, "created the schema objects that were missing") ||
		!outputHas(out, "outbox table public.outbox_events", "publication outbox_relay", "quarantine table public.outbox_quarantine") ||
		strings.Contains(out, "schema is up to date") {
		t.Errorf("first migrate: exit %d, want it to name what it created:\n%s", code, out)
	}
	code, out = harness.RunCommand(t, e.Bin, e.Args("migrate"), harness.LogLevelInfo)
	if code != 0 || !strings.Contains(out, "schema is up to date") || strings.Contains(out, "created the schema objects") {
		t.Errorf("second migrate: exit %d, want schema is up to date:\n%s", code, out)
	}

	p := e.StartRelay("--status-interval", "250ms")
	for _, line := range harness.LogLines(p.Output()) {
		if line.Str("message") != "streaming" {
			continue
		}
		if line.Str("status_interval") != "250ms" || line.Str("keepalive_every") == "" || line.Str("status_every") != "" {
			t.Errorf("streaming line %v: want status_interval 250ms and keepalive_every", line)
		}
		return
	}
	t.Fatalf("no streaming line:\n%s", p.Output())
}
