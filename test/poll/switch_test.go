package poll_test

import (
	"fmt"
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
	dups := 0
	for _, n := range harness.Duplicates(records) {
		dups += n - 1
	}
	breaks := orderBreaks(records, order)
	w.T.Logf("%s: %d events committed, %d records: 0 lost, %d duplicates, %d aggregates with an order break", what, len(ids), len(records), dups, breaks)
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
