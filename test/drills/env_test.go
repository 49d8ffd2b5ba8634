package drills

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// partitions is the partition count of every drill topic, so a test can
// compute the partition the Java client picks for a key.
const partitions = 6

// world is one drill's setting: a database with the outbox schema on some
// cluster, a Kafka (its Brokers), the relay binary, and what the drill
// committed. Its Source is "messages" to run the messages source: its
// events are then logical decoding messages (see
// harness.Ledger.EmitMessages).
type world struct {
	// Env's Ledger commits the drill's events and remembers them in
	// commit order. Commit order is the order commits return only when
	// one goroutine writes a given aggregate; the drills keep to that.
	*harness.Env
	pg *harness.Postgres
	// topicPrefix is what the relay's topic template puts before
	// {aggregate_type}; drills on a shared Apache Kafka cluster use their
	// own, so topics never collide.
	topicPrefix string
	// relayDSN is the DSN the relay gets; a drill may point it at a proxy.
	relayDSN string
	// types are the aggregate types whose topics the drill uses; the first
	// one carries the settle marker.
	types []string

	seq atomic.Int64 // numbers events across writers, for payloads
}

// newWorld creates a database for the test on pg and readies names; the
// Kafka side is given as a broker list.
func newWorld(t *testing.T, pg *harness.Postgres, brokers []string) *world {
	t.Helper()
	w := &world{Env: harness.NewRelayEnv(t, pg, 0), pg: pg, topicPrefix: "outbox.event.", types: harness.EventAggregateTypes()}
	w.Brokers, w.relayDSN = brokers, w.DB.DSN()
	return w
}

// topicRegex matches the drill's topics, for the consumer.
func (w *world) topicRegex() string {
	return "^" + strings.ReplaceAll(w.topicPrefix, ".", `\.`)
}

// topics are the drill's topic names, one per aggregate type.
func (w *world) topics() []string {
	out := make([]string, len(w.types))
	for i, a := range w.types {
		out[i] = w.topicPrefix + a
	}
	return out
}

// args are the flags every relay command of the drill uses.
func (w *world) args(cmd string, extra ...string) []string {
	return harness.RelayFlags{DSN: w.relayDSN, Slot: w.Slot, Brokers: w.Brokers, Topic: w.topicPrefix + "{aggregate_type}"}.Args(cmd, w.SourceArgs(extra...)...)
}

// startRelay starts `outbox-relay run` and waits until it streams.
func (w *world) startRelay(extra ...string) *harness.Process {
	w.T.Helper()
	return harness.StartStreaming(w.T, w.Bin, w.args("run", extra...), harness.LogLevelInfo)
}

func (w *world) startRelayNoWait(extra ...string) *harness.Process {
	w.T.Helper()
	return harness.StartProcess(w.T, w.Bin, w.args("run", extra...), []string{harness.LogLevelInfo})
}

// killAfter SIGKILLs relay life number life once it produced target more
// records to the drill's topics (committed or not; at once for 0), and
// starts the next life with flags. A life that exits on its own fails the
// drill.
func (w *world) killAfter(relay *harness.Process, off *offsets, life int, target int64, flags []string) *harness.Process {
	w.T.Helper()
	before, err := off.read(w.topics())
	if err != nil {
		w.T.Fatal(err)
	}
	if target > 0 {
		harness.WaitFor(w.T, 2*time.Minute, fmt.Sprintf("relay life %d produces %d records", life, target), func() bool {
			m, err := off.read(w.topics())
			return relay.Exited() || err == nil && sumOffsets(m)-sumOffsets(before) >= target
		})
	}
	if relay.Exited() {
		w.T.Fatalf("relay life %d exited on its own:\n%s", life, relay.Output())
	}
	relay.Kill()
	w.T.Logf("kill %d: %d events committed so far; slot at %s", life, w.CommittedCount(), w.ConfirmedFlush())
	return w.startRelayNoWait(flags...)
}

// Log lines the drills look for in the relay's JSON output.
const (
	msgRestart = "stream stopped; restarting from the slot"
	msgOrder   = "per-aggregate order on this partition may break"
)

// genEvents makes n events over aggregates aggregates, choosing aggregates
// with rng; one in five carries headers of its own.
func (w *world) genEvents(rng *mrand.Rand, n, aggregates int) []harness.OutboxEvent {
	out := make([]harness.OutboxEvent, n)
	for i := range out {
		agg := rng.IntN(aggregates)
		s := w.seq.Add(1)
		out[i] = harness.NumberedEvent(int(s), agg, fmt.Sprintf(`{"n": %d, "aggregate": %d}`, s, agg))
	}
	return out
}

// writeTxns commits txns transactions of perTxn events each.
func (w *world) writeTxns(conn *pgx.Conn, rng *mrand.Rand, txns, perTxn, aggregates int) error {
	for i := 0; i < txns; i++ {
		if err := w.Commit(context.Background(), conn, w.genEvents(rng, perTxn, aggregates)); err != nil {
			return fmt.Errorf("commit txn %d: %w", i, err)
		}
	}
	return nil
}

// connect opens a connection to the drill's database, closed at test end.
func (w *world) connect() *pgx.Conn {
	w.T.Helper()
	return w.DB.Connect(w.T)
}

// consumeAll reads until every committed event is in Kafka and returns the
// records read so far; it checks nothing else.
func (w *world) consumeAll(timeout time.Duration) []harness.Record {
	w.T.Helper()
	ids, _ := w.Committed()
	return harness.ConsumeEventIDs(w.T, w.Brokers, w.topicRegex(), ids, timeout)
}

// checkDelivery checks no loss and per-aggregate order of every committed
// event, and that within each partition first deliveries follow commit
// order.
func (w *world) checkDelivery(records []harness.Record) {
	w.T.Helper()
	ids, order := w.Committed()
	harness.CheckNoLoss(w.T, records, ids)
	harness.CheckPerAggregateOrder(w.T, records, order)
	checkPartitionOrder(w.T, records, w.CommitIndex(), nil)
}

// checkPartitionOrder checks that, in every partition not in exempt
// ("topic/partition"), the first deliveries of committed events sit in
// commit order: no later event landed before an earlier one's first copy.
// It returns, per partition, how many first deliveries came too late,
// reporting each partition's first such with t.Errorf unless it is exempt.
func checkPartitionOrder(t testing.TB, records []harness.Record, index map[string]int, exempt map[string]bool) (broken map[string]int) {
	t.Helper()
	broken = map[string]int{}
	last := map[string]int{} // highest commit position first-delivered so far
	lastID := map[string]string{}
	for _, r := range harness.FirstDeliveries(records) {
		i, ok := index[r.EventID()]
		if !ok {
			continue
		}
		tp := fmt.Sprintf("%s/%d", r.Topic, r.Partition)
		if prev, seen := last[tp]; seen && i < prev {
			broken[tp]++
			if broken[tp] == 1 && !exempt[tp] {
				t.Errorf("partition %s: event %s (#%d in commit order) first delivered at offset %d, after event %s (#%d)",
					tp, r.EventID(), i+1, r.Offset, lastID[tp], prev+1)
			}
			continue
		}
		last[tp], lastID[tp] = i, r.EventID()
	}
	return broken
}

// walsenderPID is the pid pg_stat_replication shows for the connection
// streaming the slot, 0 if none.
func (w *world) walsenderPID() int {
	w.T.Helper()
	return int(w.DB.QueryInt64(w.T, `SELECT COALESCE((SELECT r.pid FROM pg_stat_replication r
		JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $1), 0)`, w.Slot))
}

// waitSettled commits one marker event, waits until the slot confirmed it
// (so the relay has acknowledged everything committed before it and will
// re-deliver nothing), and returns every record in Kafka. The marker goes
// through the relay like any event and is checked like one.
//
// A marker, not pg_current_wal_lsn(): the relay confirms WAL that only
// other tables wrote after an outbox burst only once more WAL arrives (see
// TestDrillIdleConfirmAfterBurst), which would make this wait depend on
// background WAL.
func (w *world) waitSettled(timeout time.Duration) []harness.Record {
	w.T.Helper()
	conn, err := pgx.Connect(context.Background(), w.DB.DSN())
	if err != nil {
		w.T.Fatalf("settle: connect: %v", err)
	}
	defer conn.Close(context.Background())
	settleStart := time.Now()
	marker := w.fence(conn, []harness.OutboxEvent{{
		AggregateType: w.types[0], AggregateID: "settle-marker", EventType: "Settled", Payload: `{"marker": true}`,
	}})
	harness.WaitFor(w.T, timeout, "the slot confirms the settle marker (commit at "+marker+")", func() bool {
		return !notPast(w.ConfirmedFlush(), marker)
	})
	total := sumOffsets(endOffsets(w.T, w.Brokers, w.topics()))
	if debugTiming {
		w.T.Logf("settled: marker confirmed %v after it was committed", time.Since(settleStart))
		defer func() { w.T.Logf("settled: %d records consumed %v after the marker", total, time.Since(settleStart)) }()
	}
	return harness.ConsumeUntil(w.T, w.Brokers, w.topicRegex(), timeout, func(all []harness.Record) bool {
		return int64(len(all)) >= total
	})
}

// debugTiming (OUTBOX_RELAY_DRILL_DEBUG=1) logs how long settling takes.
var debugTiming = os.Getenv("OUTBOX_RELAY_DRILL_DEBUG") == "1"

// newRand returns a generator seeded by harness.DrillSeed, which logs the
// seed so a run can be replayed.
func newRand(t *testing.T) *mrand.Rand {
	t.Helper()
	seed := harness.DrillSeed(t)
	return mrand.New(mrand.NewPCG(seed, seed^0x5eed))
}

// startKfake starts a kfake cluster with the drill's topics pre-created.
// newKfakeWorld is a migrated world on pg with its own kfake broker, every
// topic it writes to created up front.
func newKfakeWorld(t *testing.T, pg *harness.Postgres) (*world, *harness.Kfake) {
	t.Helper()
	w := newWorld(t, pg, nil)
	k := startKfake(t, harness.KfakeOptions{}, w.topics())
	w.Brokers = k.Brokers()
	w.Migrate()
	return w, k
}

func startKfake(t *testing.T, opts harness.KfakeOptions, topics []string) *harness.Kfake {
	t.Helper()
	if opts.Partitions == 0 {
		opts.Partitions = partitions
	}
	k := harness.StartKfakeWith(t, opts)
	for _, topic := range topics {
		k.CreateTopic(t, topic, partitions, nil)
	}
	return k
}

// runWriter runs fn on its own goroutine and returns a function that waits
// for it and reports its error.
func runWriter(fn func() error) (wait func() error) {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() { err = <-done })
		return err
	}
}

// fence commits events in one transaction and returns the LSN where its
// commit record starts, read back from the WAL with pg_walinspect. The
// slot's confirmed_flush_lsn passes the transaction exactly when it
// exceeds that LSN: nothing lies between a commit record's start and its
// end. (An upper bound such as pg_current_wal_lsn() after the commit would
// let a confirm of exactly this transaction's end slip through whenever
// other WAL followed it.)
func (w *world) fence(conn *pgx.Conn, events []harness.OutboxEvent) string {
	w.T.Helper()
	ctx := context.Background()
	w.DB.Exec(w.T, "CREATE EXTENSION IF NOT EXISTS pg_walinspect")
	from := w.DB.CurrentLSN(w.T)
	tx, err := conn.Begin(ctx)
	if err != nil {
		w.T.Fatalf("fence: %v", err)
	}
	defer tx.Rollback(ctx)
	var xid string
	if err := tx.QueryRow(ctx, "SELECT (txid_current() % 4294967296)::text").Scan(&xid); err != nil {
		w.T.Fatalf("fence: %v", err)
	}
	ids := make([]string, len(events))
	for i, e := range events {
		ids[i] = harness.NewUUID()
		write, args := `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
			VALUES ($1, $2, $3, $4, $5::jsonb)`, []any{ids[i], e.AggregateType, e.AggregateID, e.EventType, e.Payload}
		if w.Source == "messages" {
			write, args = harness.EmitSQL, []any{"outbox", ids[i], e.AggregateType, e.AggregateID, e.EventType, e.Payload, nil}
		}
		if _, err := tx.Exec(ctx, write, args...); err != nil {
			w.T.Fatalf("fence: %v", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		w.T.Fatalf("fence: commit: %v", err)
	}
	w.Record(ids, events)
	// PostgreSQL 15 reads to the end of WAL with its own function; 16
	// dropped it and lets pg_get_wal_records_info read past the end.
	records := "pg_get_wal_records_info_till_end_of_wal($1::pg_lsn)"
	if w.DB.QueryInt64(w.T, "SELECT current_setting('server_version_num')::bigint") >= 160000 {
		records = "pg_get_wal_records_info($1::pg_lsn, 'FFFFFFFF/FFFFFFFF')"
	}
	lsn := w.DB.QueryString(w.T, `SELECT start_lsn::text FROM `+records+`
		WHERE xid = $2::xid AND resource_manager = 'Transaction' AND record_type LIKE 'COMMIT%'`, from, xid)
	if lsn == "" {
		w.T.Fatalf("fence: no commit record of xid %s after %s", xid, from)
	}
	return lsn
}

// notPast reports whether the slot's confirmed position has not passed the
// commit record starting at commitLSN, i.e. that transaction is not
// confirmed.
func notPast(confirmed, commitLSN string) bool { return harness.LSNAtMost(confirmed, commitLSN) }
