package drills

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillSlotIdleTimeout is PostgreSQL 18's idle_replication_slot_timeout
// invalidating the slot of a relay that is down. `migrate` and `run` must
// warn, at start, that the relay may be down for less than the timeout;
// once the slot is invalidated the relay must refuse to start and name
// PostgreSQL's invalidation_reason (idle_timeout), where it used to speak
// only of max_slot_wal_keep_size and wal_status. On older servers it skips.
func TestDrillSlotIdleTimeout(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{})
	if v := pg.Major(t); v < 18 {
		t.Skipf("PostgreSQL %d has no idle_replication_slot_timeout; run with %s=18 (make test does)", v, harness.PGVersionEnv)
	}
	// Seconds are its unit: the smallest timeout is 1s.
	pg.Exec(t, "ALTER SYSTEM SET idle_replication_slot_timeout = '1s'")
	pg.Exec(t, "SELECT pg_reload_conf()")
	harness.WaitFor(t, 30*time.Second, "idle_replication_slot_timeout = 1s in effect", func() bool {
		return pg.QueryString(t, "SHOW idle_replication_slot_timeout") == "1s"
	})
	rng := newRand(t)
	w := newWorld(t, pg, nil)
	k := startKfake(t, harness.KfakeOptions{}, w.topics())
	w.Brokers = k.Brokers()
	const warning = "idle_replication_slot_timeout is 1s: if no relay streams from the slot for longer than that"
	code, out := harness.RunCommand(t, w.Bin, harness.RelayFlags{DSN: w.DB.DSN(), Slot: w.Slot}.Args("migrate"))
	if code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	if !strings.Contains(out, warning) {
		t.Errorf("migrate does not warn about idle_replication_slot_timeout:\n%s", out)
	}
	relay := w.startRelay()
	harness.WaitFor(t, time.Minute, "the relay's warning about idle_replication_slot_timeout", func() bool {
		return strings.Contains(relay.Output(), warning)
	})
	conn := w.connect()
	if err := w.writeTxns(conn, rng, 10, 5, 20); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute)
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("relay exited %d (%v) on SIGTERM, want 0", code, err)
	}
	// Committed while the relay is down: the slot that held them goes.
	if err := w.writeTxns(conn, rng, 5, 2, 20); err != nil {
		t.Fatal(err)
	}
	// The server checks idle slots at checkpoints.
	harness.WaitFor(t, time.Minute, "PostgreSQL invalidates the idle slot", func() bool {
		w.DB.Exec(t, "CHECKPOINT")
		return w.DB.QueryString(t, "SELECT coalesce((SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = $1), '')", w.Slot) == "idle_timeout"
	})

	p := w.startRelayNoWait()
	code, err := p.Wait(2 * time.Minute)
	if err != nil {
		t.Fatalf("relay kept running on an invalidated slot: %v\n%s", err, p.Output())
	}
	if code == 0 {
		t.Errorf("relay exited 0 on an invalidated slot; want non-zero")
	}
	for _, want := range []string{"invalidation_reason=idle_timeout", "longer than idle_replication_slot_timeout", "--recreate-lost-slot"} {
		if !strings.Contains(p.Output(), want) {
			t.Errorf("relay's refusal does not say %q:\n%s", want, harness.LastLines(p.Output(), 10))
		}
	}
	t.Logf("refused with exit %d: %s", code, lastLogMessage(p.Output()))
}
