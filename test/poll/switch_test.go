package poll_test

import (
	"fmt"
	mrand "math/rand/v2"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// switchWriterEvery paces the drills' writer: 1 to 5 events a tick, about
// 250 events/s.
const switchWriterEvery = 12 * time.Millisecond

// orderBreaks counts the aggregates whose events' first deliveries are
// not in commit order (or not on one partition).
func orderBreaks(records []harness.Record, commitOrder map[string][]string) int {
	first := map[string]harness.Record{}
	for _, r := range harness.FirstDeliveries(records) {
		first[r.EventID()] = r
	}
	breaks := 0
	for _, ids := range commitOrder {
		var prev *harness.Record
		for _, id := range ids {
			r, ok := first[id]
			if !ok {
				continue
			}
			if prev != nil && (r.Topic != prev.Topic || r.Partition != prev.Partition || r.Offset < prev.Offset) {
				breaks++
				break
			}
			prev = &r
		}
	}
	return breaks
}

// drillCount reads every committed event back with the independent
// client and reports lost, duplicated and reordered events; it fails the
// test on any loss or order break.
func (w *world) drillCount(what string) {
	w.T.Helper()
	ids, order := w.Committed()
	records := harness.ConsumeEventIDs(w.T, w.Kafka.Brokers(), harness.RelayTopics, ids, 3*time.Minute)
	mine := make(map[string]bool, len(ids))
	for _, id := range ids {
		mine[id] = true
	}
	delivered, dups := 0, 0
	for _, r := range records {
		if mine[r.EventID()] {
			delivered++
		}
	}
	for id, n := range harness.Duplicates(records) {
		if mine[id] {
			dups += n - 1
		}
	}
	breaks := orderBreaks(records, order)
	w.T.Logf("%s: %d events committed, %d deliveries of them: 0 lost, %d duplicates, %d aggregates with an order break", what, len(ids), delivered, dups, breaks)
	harness.CheckPerAggregateOrder(w.T, records, order)
}

// Issue 51, item 2: the switch from the lease strategy to the snapshot
// strategy, as docs/poll-snapshot.md says it, step by step, with a writer
// at about 250 events/s throughout. Before, `migrate --poll-existing
// published` took every row without a transaction id as published, so
// the events written between the lease pollers' stop and the migration
// were never published, though the lease state table held them as
// pending (a run: 610 of 9,000 lost, 50 order breaks). Now "published"
// means what the lease state table says, and its pending rows go first,
// in its order. Full size: a minute of writes, 10 s between the stop and
// the migration.
func TestDrillSwitchFromLeaseToSnapshotWithWritersRunning(t *testing.T) {
	w := newWorld(t, cluster.CreateTestDatabase(t))
	w.startPollers(2)
	wr := w.startWriter(w.DB.DSN(), switchWriterEvery, 200)
	gap := harness.Sized(1000, 2500) // events written while no poller runs
	waitWritten := func(n int) {
		target := w.CommittedCount() + n
		harness.WaitFor(t, 2*time.Minute, fmt.Sprintf("%d events committed", target), func() bool { return w.CommittedCount() >= target })
	}
	waitWritten(harness.Sized(500, 5000))

	// 1. Stop the lease pollers.
	for i, p := range w.pollers {
		if code, err := p.Stop(30 * time.Second); err != nil || code != 0 {
			t.Fatalf("lease poller %d stopped with %d, %v:\n%s", i, code, err, p.Output())
		}
	}
	w.pollers = nil
	waitWritten(gap)
	// 2. migrate --poll-strategy snapshot --poll-existing published.
	w.Migrate("--poll-strategy", "snapshot", "--poll-existing", "published")
	pendingByLease := w.DB.QueryInt64(t, `SELECT count(*) FROM outbox_events_poll s JOIN outbox_events o USING (event_id)
		WHERE s.published_at IS NULL AND o.outbox_relay_xid IS NULL`)
	t.Logf("at the migration, the lease state held %d rows from before it as pending", pendingByLease)
	if pendingByLease < int64(gap)/2 {
		t.Fatalf("only %d rows pending at the migration: the drill did not write while no poller ran", pendingByLease)
	}
	waitWritten(harness.Sized(200, 1000))
	// 3. Drop the lease trigger.
	w.DB.Exec(t, "DROP TRIGGER outbox_events_poll_track ON outbox_events")
	waitWritten(harness.Sized(200, 1000))
	// 4. Start the snapshot poller.
	p := harness.StartProcess(t, w.Bin, w.pollArgs(append([]string{"--poll-batch", fmt.Sprint(drillBatch)}, snapshotFlags...)...), []string{harness.LogLevelInfo})
	p.WaitForOutput(t, `"message":"polling"`, time.Minute)
	waitWritten(harness.Sized(1000, 5000))
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	w.drillCount("switch from lease to snapshot")
	if p.Exited() {
		t.Errorf("the snapshot poller exited:\n%s", p.Output())
	}
}

// Issue 51, item 2, the way back: from the snapshot strategy to the lease
// strategy, as docs/poll-snapshot.md says it, with a writer at about 250
// events/s throughout. `migrate --source poll --poll-existing published`
// took every row as published, so the events written after the snapshot
// poller stopped (and those of a window it had not finished) were never
// published. Now "published" means what the snapshot strategy's progress
// covers, and the rows it does not are pending, in insertion order.
func TestDrillSwitchFromSnapshotToLeaseWithWritersRunning(t *testing.T) {
	w := &world{env: newSnapEnv(t), rng: mrand.New(mrand.NewPCG(harness.DrillSeed(t), 0))}
	snap := harness.StartProcess(t, w.Bin, w.pollArgs(append([]string{"--poll-batch", fmt.Sprint(drillBatch)}, snapshotFlags...)...), []string{harness.LogLevelInfo})
	snap.WaitForOutput(t, `"message":"polling"`, time.Minute)
	wr := w.startWriter(w.DB.DSN(), switchWriterEvery, 200)
	waitWritten := func(n int) {
		target := w.CommittedCount() + n
		harness.WaitFor(t, 2*time.Minute, fmt.Sprintf("%d events committed", target), func() bool { return w.CommittedCount() >= target })
	}
	waitWritten(harness.Sized(500, 5000))

	// 1. Stop the snapshot poller.
	if code, err := snap.Stop(30 * time.Second); err != nil || code != 0 {
		t.Fatalf("snapshot poller stopped with %d, %v:\n%s", code, err, snap.Output())
	}
	waitWritten(harness.Sized(1000, 2500))
	// 2. migrate --source poll --poll-existing published.
	w.Migrate("--poll-existing", "published")
	pending := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE published_at IS NULL")
	t.Logf("at the migration, %d rows the snapshot strategy's progress does not cover were tracked as pending", pending)
	waitWritten(harness.Sized(200, 1000))
	// 3. Drop the snapshot strategy's trigger.
	w.DB.Exec(t, "DROP TRIGGER outbox_events_poll_snapshot_notify ON outbox_events")
	waitWritten(harness.Sized(200, 1000))
	// 4. Start the lease pollers.
	w.startPollers(2)
	waitWritten(harness.Sized(1000, 5000))
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	w.drillCount("switch from snapshot to lease")
}

// The two-phase commit procedure of docs/poll-mode.md (and
// docs/poll-snapshot.md), followed literally with a writer at about 250
// events/s throughout: migrate with --poll-notify=false while the pollers
// run, restart each poller with --poll-notify=false, then the writer
// prepares its transactions (PREPARE TRANSACTION, COMMIT PREPARED).
func TestDrillTwoPhaseCommitProcedureWithWritersRunning(t *testing.T) {
	for _, strategy := range []string{"lease", "snapshot"} {
		t.Run(strategy, func(t *testing.T) {
			w := memoryWorld(t, strategy)
			flags := []string{"--poll-strategy", strategy}
			pollers := 2
			if strategy == "snapshot" {
				pollers = 1 // and no standby: its restart is the step
			}
			w.startPollers(pollers, flags...)
			wr := w.startWriter(w.DB.DSN(), switchWriterEvery, 200)
			waitWritten := func(n int) {
				target := w.CommittedCount() + n
				harness.WaitFor(t, 2*time.Minute, fmt.Sprintf("%d events committed", target), func() bool { return w.CommittedCount() >= target })
			}
			waitWritten(harness.Sized(300, 3000))
			// 1. migrate --poll-notify=false, on the table migrated before.
			w.Migrate(append(flags, "--poll-notify=false")...)
			waitWritten(harness.Sized(200, 1000))
			// 2. Run the pollers with --poll-notify=false: each restarted.
			for i, p := range w.pollers {
				if code, err := p.Stop(30 * time.Second); err != nil || code != 0 {
					t.Fatalf("poller %d stopped with %d, %v:\n%s", i, code, err, p.Output())
				}
				w.restart(i, append(flags, "--poll-notify=false")...)
			}
			waitWritten(harness.Sized(200, 1000))
			// 3. The writer prepares its transactions.
			wr.prepare.Store(true)
			waitWritten(harness.Sized(1000, 5000))
			if err := wr.halt(); err != nil {
				t.Fatal(err)
			}
			w.drillCount(strategy + " strategy, two-phase commit procedure")
		})
	}
}
