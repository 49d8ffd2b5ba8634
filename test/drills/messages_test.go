package drills

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// msgNonTransactional is the relay's log line for a non-transactional
// message of its prefix, logged once per process.
const msgNonTransactional = "read a non-transactional logical decoding message with this relay's prefix"

// TestDrillMessages runs the messages source (--source messages) through
// the table source's core drills, in both delivery modes, checked with the
// independent client: SIGKILLs at random moments under a live writer, then
// a PostgreSQL immediate restart, with messages that must never be
// published emitted all along (in transactions that roll back, outside any
// transaction, and under another prefix). No committed event may be lost,
// the first deliveries of each aggregate keep commit order, and in
// exactly-once mode read_committed readers see each event once.
//
// Reduced: 3 kills; OUTBOX_RELAY_DRILL_SIZE=full: 10 kills.
func TestDrillMessages(t *testing.T) {
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) { messagesDrill(t, mode == "exactly-once") })
	}
}

func messagesDrill(t *testing.T, exactlyOnce bool) {
	kills := harness.Sized(3, 10)
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{})
	w := newWorld(t, pg, nil)
	w.Source = "messages"
	w.EmitMessages(t, w.DB, "outbox")
	w.Brokers = startKfake(t, harness.KfakeOptions{}, w.topics()).Brokers()
	w.Migrate()
	if n := w.DB.QueryInt64(t, "SELECT count(*) FROM pg_class WHERE relname = 'outbox_events'"); n != 0 {
		t.Fatalf("migrate --source messages created an outbox table")
	}
	off := newOffsets(t, w.Brokers)
	var flags []string
	if exactlyOnce {
		flags = eosFlags
	}
	forbidden := map[string]string{} // event ID -> why it must never be published

	pw := startPacedWriter(w, w.connect(), writerRand(rng), 5*time.Millisecond, 7, 300, false)
	defer pw.halt()
	side := w.connect()
	relay := w.startRelayNoWait(flags...)
	for i := range kills {
		w.emitForbidden(side, forbidden)
		relay = w.killAfter(relay, off, i+1, int64(200+rng.IntN(2000)), flags)
	}

	relay.WaitForOutput(t, harness.LogStreaming, 2*time.Minute)
	streams := strings.Count(relay.Output(), harness.LogStreaming)
	pg.StopImmediate(t)
	werr := pw.halt() // the crash ends it; its last COMMIT is in doubt until settled
	t.Logf("PostgreSQL crashed with %d events committed (writer stopped on: %v)", w.CommittedCount(), werr)
	pg.Start(t)
	harness.WaitFor(t, 2*time.Minute, "the relay streams again", func() bool {
		return relay.Exited() || strings.Count(relay.Output(), harness.LogStreaming) > streams
	})
	if relay.Exited() {
		t.Fatalf("relay exited after the PostgreSQL crash:\n%s", relay.Output())
	}
	pw.doubt.settle(t, w)
	w.emitForbidden(w.connect(), forbidden)
	w.emitForbidden(w.connect(), forbidden)
	if err := w.writeTxns(w.connect(), rng, 50, 7, 300); err != nil {
		t.Fatal(err)
	}

	var records []harness.Record
	if exactlyOnce {
		checkTxnsCommitted(t, relay.Output())
		records = w.settleExactlyOnce(3 * time.Minute) // refuses a record of an event never committed
	} else {
		records = w.waitSettled(3 * time.Minute)
		w.checkDelivery(records)
	}
	for _, r := range records {
		if why, ok := forbidden[r.EventID()]; ok {
			t.Errorf("event %s was published at %s/%d@%d: %s", r.EventID(), r.Topic, r.Partition, r.Offset, why)
		}
	}
	// This life read at least two of them; it says so once.
	if n := strings.Count(relay.Output(), msgNonTransactional); n != 1 {
		t.Errorf("the last relay life logged %d lines about non-transactional messages, want 1:\n%s", n, harness.LastLines(relay.Output(), 20))
	}
	t.Logf("messages drill (%s): %d kills and a PostgreSQL crash, %d events, %d records, %d never-publish messages never published",
		map[bool]string{false: "at-least-once", true: "exactly-once"}[exactlyOnce], kills, w.CommittedCount(), len(records), len(forbidden))
}

// emitForbidden emits three messages the relay must never publish, each
// with a valid event's content: one in a transaction that rolls back, one
// outside any transaction with the relay's prefix, and one of another
// prefix in a committed transaction. It notes their IDs in forbidden.
func (w *world) emitForbidden(conn *pgx.Conn, forbidden map[string]string) {
	w.T.Helper()
	ctx := context.Background()
	emit := func(q pgx.Tx, prefix, why string) {
		id := harness.NewUUID()
		forbidden[id] = why
		if _, err := q.Exec(ctx, harness.EmitSQL, prefix, id, "order", "forbidden", "Never", `{"never": true}`, nil); err != nil {
			w.T.Fatalf("emit a message that must not be published: %v", err)
		}
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		w.T.Fatal(err)
	}
	emit(tx, "outbox", "its transaction rolled back")
	if err := tx.Rollback(ctx); err != nil {
		w.T.Fatal(err)
	}
	id := harness.NewUUID()
	forbidden[id] = "it was emitted outside a transaction"
	nonTxn := strings.Replace(harness.EmitSQL, "pg_logical_emit_message(true,", "pg_logical_emit_message(false,", 1)
	if _, err := conn.Exec(ctx, nonTxn, "outbox", id, "order", "forbidden", "Never", `{"never": true}`, nil); err != nil {
		w.T.Fatal(err)
	}
	tx, err = conn.Begin(ctx)
	if err != nil {
		w.T.Fatal(err)
	}
	emit(tx, "outbox-other", "it has another prefix")
	if err := tx.Commit(ctx); err != nil {
		w.T.Fatal(err)
	}
}
