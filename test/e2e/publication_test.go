package e2e

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

var reconcileSince = regexp.MustCompile(`every event committed since (\S+) that Kafka lacks`)

// Issue 24.3: with the relay streaming, DROP PUBLICATION and one insert
// made it exit 1 saying to run `migrate`; after migrate created the
// publication again, it looped forever on `publication "outbox_relay" does
// not exist`, because PostgreSQL decodes that WAL with the catalog of its
// time. The relay now stops at once, every time, with the real way out: a
// new slot made by a recovery that republishes from a time it fills in
// (issue 51: no longer reconcile by hand after the slot). Following it
// delivers every event.
func TestDroppedPublicationStopsWithTheWayOut(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	p := e.StartRelay()
	conn := e.DB.Connect(t)
	ctx := context.Background()
	if err := e.writeEvents(conn, 1, 1, 1); err != nil {
		t.Fatal(err)
	}
	written := e.DB.CurrentLSN(t)
	e.ConsumeAll(time.Minute)
	harness.WaitFor(t, 30*time.Second, "the slot confirmed past the first event", func() bool {
		return harness.LSNAtMost(written, e.ConfirmedFlush())
	})

	if _, err := conn.Exec(ctx, "DROP PUBLICATION outbox_relay"); err != nil {
		t.Fatal(err)
	}
	if err := e.writeEvents(conn, 1, 1, 1); err != nil { // only the recovery can deliver this one
		t.Fatal(err)
	}
	wayOut := func(p *harness.Process) string {
		t.Helper()
		code, err := p.Wait(time.Minute)
		if err != nil {
			p.Kill()
			t.Fatalf("relay after DROP PUBLICATION: %v; output tail:\n%s", err, harness.LastLines(p.Output(), 20))
		}
		out := p.Output()
		m := reconcileSince.FindStringSubmatch(out)
		if code != 1 || m == nil || !outputHas(out, `publication \"outbox_relay\" does not exist`, "pg_drop_replication_slot('"+e.Slot+"')", "outbox-relay migrate --skip-slot", "--on-slot-lost recover") {
			t.Fatalf("exit %d, want 1 with the way out (drop the slot, migrate, recover from a time):\n%s", code, out)
		}
		since, err := time.Parse(time.RFC3339, m[1])
		if err != nil || time.Since(since) > 2*time.Hour || since.After(time.Now()) {
			t.Fatalf("since %q is not the last confirmed commit time less the margin", m[1])
		}
		return m[1]
	}
	wayOut(p)

	// The advice of the missing-publication check alone: migrate creates
	// the publication again. The slot still cannot pass the gap, and the
	// relay must say so again instead of looping.
	e.Migrate()
	wayOut(e.StartRelayNoWait())

	// The way out, as printed.
	e.DB.DropSlot(t, e.Slot)
	e.Migrate("--skip-slot")
	p = e.StartRelay("--on-slot-lost", "recover")
	if !strings.Contains(p.Output(), "recovered the lost replication slot") {
		t.Errorf("the way out did not recover the gap:\n%s", harness.LastLines(p.Output(), 10))
	}
	if err := e.writeEvents(conn, 2, 1, 2); err != nil {
		t.Fatal(err)
	}
	// The recovery republishes the gap before the new slot streams.
	ids, _ := e.Committed()
	harness.CheckNoLoss(t, harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, ids, time.Minute), ids)
}
