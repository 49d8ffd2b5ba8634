package drills

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// rssBound is the relay's allowed peak RSS while it publishes one 200,000-row
// transaction. Measured on a 2-core machine: 39 to 50 MiB (the in-flight
// bound, 2,000 events or 64 MiB of records, is what holds it; the
// transaction's size must not matter). 160 MiB leaves room for the Go
// runtime's and sarama's slack without letting a relay that buffers the
// transaction (200,000 rows of ~330 bytes, plus per-record overhead,
// several hundred MiB) pass.
const rssBound = 160 << 20

// TestDrillLargeAndAbortedTransactions commits one transaction of 200,000
// outbox rows while another, of the same size and interleaved with it,
// aborts. Without streaming, PostgreSQL sends a transaction only at commit
// (spilling it to disk beyond logical_decoding_work_mem) and never sends an
// aborted one. Expect every committed row delivered exactly once (a clean
// run restarts nothing, so records == rows), none of the aborted ones, and
// the relay's memory bounded by its in-flight limit, not by the
// transaction.
func TestDrillLargeAndAbortedTransactions(t *testing.T) {
	const rows = 200_000
	w := newWorld(t, shared, nil)
	w.types = []string{"order", "bulk", "aborted"}
	k := startKfake(t, harness.KfakeOptions{}, w.topics())
	w.Brokers = k.Brokers()
	w.Migrate()
	relay := w.startRelay()
	ctx := context.Background()

	// The aborted transaction starts first and is still open while the
	// committed one is written, so their changes interleave in the WAL.
	aborting := w.connect()
	tx, err := aborting.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	if _, err := tx.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
		SELECT gen_random_uuid(), 'aborted', 'agg-' || (i % 1000), 'Aborted', jsonb_build_object('i', i, 'pad', repeat('a', 200))
		FROM generate_series(1, $1::int) AS i`, rows/2); err != nil {
		t.Fatal(err)
	}
	ids, err := w.CommitBulk(ctx, w.connect(), "bulk", rows)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
		SELECT gen_random_uuid(), 'aborted', 'agg-' || (i % 1000), 'Aborted', jsonb_build_object('i', i, 'pad', repeat('a', 200))
		FROM generate_series($1::int + 1, $2::int) AS i`, rows/2, rows); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %d committed and %d aborted rows in %v", rows, rows, time.Since(began).Round(time.Millisecond))

	if len(ids) != rows {
		t.Fatalf("inserted %d bulk rows, want %d", len(ids), rows)
	}
	records := w.waitSettled(10 * time.Minute)
	delivered := time.Since(began)
	peak, err := harness.PeakRSS(relay.Pid())
	if err != nil {
		t.Fatalf("peak RSS of the relay: %v", err)
	}
	w.checkDelivery(records)
	perTopic := map[string]int{}
	for _, r := range records {
		perTopic[strings.TrimPrefix(r.Topic, w.topicPrefix)]++
	}
	if perTopic["bulk"] != rows {
		t.Errorf("%d records of the committed transaction, want exactly %d (no restarts, so no duplicates)", perTopic["bulk"], rows)
	}
	if perTopic["aborted"] != 0 {
		t.Errorf("%d records of the aborted transaction were published", perTopic["aborted"])
	}
	if n := strings.Count(relay.Output(), msgRestart); n > 0 {
		t.Errorf("relay restarted its stream %d times in a clean run", n)
	}
	if peak > rssBound {
		t.Errorf("relay peak RSS %d MiB while publishing one %d-row transaction; bound %d MiB", peak>>20, rows, rssBound>>20)
	}
	t.Logf("%d-row transaction delivered exactly once in %v, aborted one never; relay peak RSS (VmHWM) %.1f MiB",
		rows, delivered.Round(time.Millisecond), float64(peak)/(1<<20))
}
