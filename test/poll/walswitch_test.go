package poll_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Issue 51: the switch from polling to the WAL path, as
// docs/polling-or-cdc.md says it, step by step, with a writer at about 250
// events/s throughout. It used to say: run `migrate` while the pollers run
// (it made the slot over the table's rows), stop the pollers, start the
// WAL relay: the rows committed before the slot that the pollers had not
// published when they stopped were in no slot and never published. migrate
// now refuses to make a slot over rows no record covers, and the WAL relay
// started once with --existing-rows pending makes its slot with a snapshot
// and publishes every row Kafka lacks before it streams.
func TestDrillSwitchFromPollingToWALWithWritersRunning(t *testing.T) {
	w := newWorld(t, cluster.CreateTestDatabase(t))
	w.startPollers(2)
	wr := w.startWriter(w.DB.DSN(), switchWriterEvery, 200)
	waitWritten := func(n int) {
		target := w.CommittedCount() + n
		harness.WaitFor(t, 2*time.Minute, fmt.Sprintf("%d events committed", target), func() bool { return w.CommittedCount() >= target })
	}
	waitWritten(harness.Sized(500, 5000))
	slot := "switched_to_wal"
	w.DB.DropSlotAtEnd(t, slot)

	// 1. migrate --skip-slot: the publication, while the pollers run.
	harness.Migrate(t, w.Bin, []string{"migrate", "--pg-dsn", w.DB.DSN(), "--slot", slot, "--skip-slot"})
	// 2. Stop the pollers.
	for i, p := range w.pollers {
		if code, err := p.Stop(30 * time.Second); err != nil || code != 0 {
			t.Fatalf("poller %d stopped with %d, %v:\n%s", i, code, err, p.Output())
		}
	}
	w.pollers = nil
	waitWritten(harness.Sized(500, 2500))
	pending := w.unpublished()
	t.Logf("%d rows pending in the lease state when the WAL relay starts", pending)
	if pending < 100 {
		t.Fatalf("only %d rows pending: the drill did not write while nothing published", pending)
	}
	// 3. Start the WAL relay once with --existing-rows pending.
	wal := harness.StartProcess(t, w.Bin, harness.RelayFlags{DSN: w.DB.DSN(), Slot: slot, Brokers: w.Kafka.Brokers()}.Args("run", "--existing-rows", "pending"),
		[]string{harness.LogLevelInfo})
	wal.WaitForOutput(t, harness.LogStreaming, 2*time.Minute)
	waitWritten(harness.Sized(1000, 5000))
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	w.drillCount("switch from polling to the WAL path")
	if wal.Exited() {
		t.Errorf("the WAL relay exited:\n%s", wal.Output())
	}
}

// The switch from the WAL path to polling, as docs/polling-or-cdc.md says
// it, with a writer at about 250 events/s throughout: migrate --source
// poll --poll-existing published while the WAL relay runs, stop the WAL
// relay, start the pollers, drop the slot.
func TestDrillSwitchFromWALToPollingWithWritersRunning(t *testing.T) {
	w := newWorld(t, cluster.CreateTestDatabase(t))
	slot := "before_polling"
	w.DB.DropSlotAtEnd(t, slot)
	harness.Migrate(t, w.Bin, []string{"migrate", "--pg-dsn", w.DB.DSN(), "--slot", slot})
	wal := harness.StartStreaming(t, w.Bin, harness.RelayFlags{DSN: w.DB.DSN(), Slot: slot, Brokers: w.Kafka.Brokers()}.Args("run"), harness.LogLevelInfo)
	wr := w.startWriter(w.DB.DSN(), switchWriterEvery, 200)
	waitWritten := func(n int) {
		target := w.CommittedCount() + n
		harness.WaitFor(t, 2*time.Minute, fmt.Sprintf("%d events committed", target), func() bool { return w.CommittedCount() >= target })
	}
	waitWritten(harness.Sized(500, 5000))
	// 1. migrate --source poll --poll-existing published, the WAL relay running.
	harness.Migrate(t, w.Bin, []string{"migrate", "--pg-dsn", w.DB.DSN(), "--source", "poll", "--poll-existing", "published"})
	waitWritten(harness.Sized(200, 1000))
	// 2. Stop the WAL relay.
	if code, err := wal.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("WAL relay stopped with %d, %v:\n%s", code, err, wal.Output())
	}
	waitWritten(harness.Sized(200, 1000))
	// 3. Start the pollers. 4. Drop the slot.
	w.startPollers(2)
	w.DB.DropSlot(t, slot)
	waitWritten(harness.Sized(1000, 5000))
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	w.drillCount("switch from the WAL path to polling")
}
