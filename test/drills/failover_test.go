package drills

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// physicalSlot is the standby's slot on the primary in the failover drill.
const physicalSlot = "relay_standby"

// TestDrillFailoverSlotPromotion is a real failover with a failover slot
// (PostgreSQL 17+): a primary and a streaming standby with slot
// synchronisation, the relay streaming through a slot made by `migrate
// --slot-failover` while a writer commits. The primary stops the way a crash
// does (-m immediate), the standby is promoted, and the relay, given both
// servers in one connection string with target_session_attrs=read-write,
// follows on its own. Every committed event must arrive, read by an
// independent client, with the re-delivery reported; in exactly-once mode
// read_committed readers see each event once.
//
// Commits are synchronous to the standby and the primary's
// synchronized_standby_slots names the standby's slot, so the standby has
// every committed event and the relay never received a change the standby
// lacks. The drill runs on 17 and 18 (`make test` runs it with
// OUTBOX_RELAY_PG_VERSION); on older servers it skips.
func TestDrillFailoverSlotPromotion(t *testing.T) {
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) {
			failoverDrill(t, mode == "exactly-once")
		})
	}
}

// failoverPair starts a primary and, by copy, its streaming standby with
// slot synchronisation on, and a world (with kfake) on the primary. It
// skips below PostgreSQL 17, which has no failover slots.
func failoverPair(t *testing.T) (w *world, pg, standby *harness.Postgres) {
	t.Helper()
	pg = harness.StartPostgres(t, harness.PGOptions{})
	if v := pg.Major(t); v < 17 {
		t.Skipf("PostgreSQL %d has no failover slots; run with %s=17 or 18 (make test does)", v, harness.PGVersionEnv)
	}
	w = newWorld(t, pg, nil)
	k := startKfake(t, harness.KfakeOptions{}, w.topics())
	w.Brokers = k.Brokers()
	standby = pg.CopyStandby(t, physicalSlot, map[string]string{"sync_replication_slots": "on", "hot_standby_feedback": "on"})
	return w, pg, standby
}

func failoverDrill(t *testing.T, exactlyOnce bool) {
	w, pg, standby := failoverPair(t)
	rng := newRand(t)
	pg.Exec(t, fmt.Sprintf("ALTER SYSTEM SET synchronized_standby_slots = '%s'", physicalSlot))
	pg.Exec(t, fmt.Sprintf("ALTER SYSTEM SET synchronous_standby_names = '%s'", physicalSlot))
	pg.Exec(t, "SELECT pg_reload_conf()")
	harness.Migrate(t, w.Bin, harness.RelayFlags{DSN: w.DB.DSN(), Slot: w.Slot}.Args("migrate", "--slot-failover"))

	// Both servers in one connection string: the relay connects to the
	// one that accepts writes.
	w.relayDSN = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/%s?target_session_attrs=read-write",
		pg.Port(), standby.Port(), w.DB.Name())
	flags := []string{"--slot-failover", "--status-interval", "300ms"}
	if exactlyOnce {
		flags = append(flags, eosFlags...)
	}
	relay := w.startRelay(flags...)
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 20*time.Millisecond, 5, 100, false)
	defer pw.halt()

	// The standby must hold the slot, synchronised past events the relay
	// confirmed, before the primary goes: a slot nothing synced yet is
	// not there after the promotion (see docs/postgres-failover.md).
	harness.WaitFor(t, 2*time.Minute, "500 events committed and confirmed", func() bool {
		return pw.events.Load() >= 500 && !notPast(w.ConfirmedFlush(), "0/0")
	})
	confirmed := w.ConfirmedFlush()
	harness.WaitFor(t, 2*time.Minute, "the standby's synced slot reaches "+confirmed, func() bool {
		synced := standby.QueryString(t, `SELECT coalesce((SELECT confirmed_flush_lsn::text FROM pg_replication_slots
			WHERE slot_name = $1 AND synced), '')`, w.Slot)
		return synced != "" && harness.LSNAtMost(confirmed, synced)
	})

	pg.StopImmediate(t)
	werr := pw.halt()
	failedAt := time.Now()
	standby.Promote(t)
	n := w.on(standby)
	n.Ledger = w.Ledger
	pw.doubt.settle(t, n)
	t.Logf("primary stopped with -m immediate after %d events (writer: %v); standby promoted in %v",
		w.CommittedCount(), werr, time.Since(failedAt).Round(time.Millisecond))
	if !strings.Contains(standby.QueryString(t, "SELECT coalesce((SELECT slot_name FROM pg_replication_slots WHERE slot_name = $1), '')", w.Slot), w.Slot) {
		t.Fatalf("the promoted standby has no slot %s: it was never synchronised", w.Slot)
	}

	streams := strings.Count(relay.Output(), harness.LogStreaming)
	harness.WaitFor(t, 2*time.Minute, "the relay streams from the promoted standby", func() bool {
		return relay.Exited() || strings.Count(relay.Output(), harness.LogStreaming) > streams
	})
	if relay.Exited() {
		t.Fatalf("the relay exited after the failover:\n%s", relay.Output())
	}
	followed := time.Since(failedAt)
	nconn := n.connect()
	if err := n.writeTxns(nconn, rng, 20, 5, 100); err != nil {
		t.Fatal(err)
	}

	var records []harness.Record
	if exactlyOnce {
		records = n.settleExactlyOnce(2 * time.Minute)
		checkTxnsCommitted(t, relay.Output())
	} else {
		records = n.waitSettled(2 * time.Minute)
		n.checkDelivery(records)
	}
	redelivered := len(records) - len(harness.FirstDeliveries(records))
	t.Logf("PostgreSQL %d, %s: %d events, %d records, %d re-delivered; the relay streamed from the new primary %v after the old one stopped",
		standby.Major(t), map[bool]string{false: "at-least-once", true: "exactly-once"}[exactlyOnce],
		n.CommittedCount(), len(records), redelivered, followed.Round(time.Millisecond))
}

// TestDrillFailoverSlotNotSyncedStatus: a failover slot that nothing
// consumes never synchronises to the standby (PostgreSQL logs "could not
// synchronize replication slot" there, and promotion drops its temporary
// copy), which an operator who ran `migrate --slot-failover` and starts the
// relay later meets only at the failover. `outbox-relay status` must say so,
// on the primary and on the standby, and stop saying it once the relay
// streamed and the standby holds the slot. PostgreSQL 17+; skips before.
func TestDrillFailoverSlotNotSyncedStatus(t *testing.T) {
	w, pg, standby := failoverPair(t)
	rng := newRand(t)
	harness.Migrate(t, w.Bin, harness.RelayFlags{DSN: w.DB.DSN(), Slot: w.Slot}.Args("migrate", "--slot-failover"))
	status := func(on *harness.Postgres) string {
		t.Helper()
		_, out := harness.RunCommand(t, w.Bin, harness.RelayFlags{DSN: on.DB(w.DB.Name()).DSN(), Slot: w.Slot}.Args("status"))
		return out
	}

	if out := status(pg); !strings.Contains(out, "has decoded no transaction since it was created") || !strings.Contains(out, `"failover_warning"`) {
		t.Errorf("status on the primary does not warn that the unconsumed failover slot cannot synchronise:\n%s", out)
	}
	var onStandby string
	harness.WaitFor(t, time.Minute, "the standby to try to synchronise the slot", func() bool {
		return strings.Contains(standby.LogTail(200), "could not synchronize replication slot")
	})
	onStandby = status(standby)
	if !strings.Contains(onStandby, "not synchronised to this standby yet") && !strings.Contains(onStandby, "is not on this standby") {
		t.Errorf("status on the standby does not say the slot is not synchronised:\n%s", onStandby)
	}
	for _, line := range strings.Split(onStandby, "\n") {
		if strings.Contains(line, "standby") {
			t.Logf("status on the standby before the relay ran: %s", line)
			break
		}
	}

	relay := w.startRelay("--slot-failover")
	defer relay.Kill()
	conn := w.connect()
	if err := w.writeTxns(conn, rng, 10, 5, 20); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute)
	harness.WaitFor(t, time.Minute, "the standby to hold the synchronised slot", func() bool {
		return standby.QueryString(t, "SELECT coalesce((SELECT (synced AND NOT temporary)::text FROM pg_replication_slots WHERE slot_name = $1), '')", w.Slot) == "true"
	})
	for what, out := range map[string]string{"primary": status(pg), "standby": status(standby)} {
		if strings.Contains(out, "failover_warning") || strings.Contains(out, "warning:") {
			t.Errorf("status on the %s still warns once the relay streamed and the standby synchronised the slot:\n%s", what, out)
		}
	}
}
