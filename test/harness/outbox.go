package harness

import (
	"context"
	"crypto/rand"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
)

// OutboxEvent is one outbox row a test commits.
type OutboxEvent struct {
	AggregateType, AggregateID, EventType string
	Payload, Headers                      string // JSON; Headers "" writes NULL
}

// EventAggregateTypes are the aggregate types NumberedEvent cycles
// through; with the relay's default topic template each is one topic.
func EventAggregateTypes() []string { return []string{"order", "customer", "invoice"} }

// NumberedEvent is event number n of a test's stream, for aggregate number
// agg, with payload: its aggregate type is EventAggregateTypes()[agg%3], its
// aggregate id agg-<agg>, and every fifth event (n divisible by 5) carries
// headers of its own, a tenant and a W3C traceparent, so the relay's header
// path runs too.
func NumberedEvent(n, agg int, payload string) OutboxEvent {
	types := EventAggregateTypes()
	e := OutboxEvent{
		AggregateType: types[agg%len(types)],
		AggregateID:   fmt.Sprintf("agg-%d", agg),
		EventType:     "Happened",
		Payload:       payload,
	}
	if n%5 == 0 {
		e.Headers = fmt.Sprintf(`{"tenant": "t%d", "traceparent": "00-%032x-%016x-01"}`, agg%7, n, n)
	}
	return e
}

// Ledger commits outbox events and remembers every committed event_id in
// commit order, overall and per aggregate, for CheckNoLoss and
// CheckPerAggregateOrder. It is safe for concurrent use.
//
// Commit order is the order commits return only when one goroutine writes
// a given aggregate; tests checking per-aggregate order keep to that.
type Ledger struct {
	// prefix, when set, makes the ledger emit logical decoding messages
	// with it instead of inserting outbox rows (see EmitMessages).
	prefix string

	mu          sync.Mutex
	ids         []string            // committed event ids, in commit order
	index       map[string]int      // event id -> position in ids
	commitOrder map[string][]string // aggregate id -> event ids in commit order
}

// NewLedger returns an empty Ledger.
func NewLedger() *Ledger {
	return &Ledger{index: map[string]int{}, commitOrder: map[string][]string{}}
}

// EmittedTable is the table a ledger that emits messages writes each
// event's ID to, in the same transaction: the business change a real
// service would make, and what tells a test whether a transaction whose
// COMMIT got no answer committed.
const EmittedTable = "emitted_events"

// EmitMessages makes the ledger write events as the messages source reads
// them: pg_logical_emit_message(true, prefix, content), the content built
// as the writer library's Emit builds it, with each event's ID also
// inserted into EmittedTable, which it creates in db.
func (l *Ledger) EmitMessages(t testing.TB, db *PGDatabase, prefix string) *Ledger {
	t.Helper()
	db.Exec(t, "CREATE TABLE IF NOT EXISTS "+EmittedTable+" (event_id uuid PRIMARY KEY, aggregate_id text NOT NULL)")
	l.prefix = prefix
	return l
}

// Table is where the ledger's events can be counted and looked up by
// event_id: the outbox table, or EmittedTable.
func (l *Ledger) Table() string {
	if l.prefix != "" {
		return EmittedTable
	}
	return "outbox_events"
}

// Commit writes events to outbox_events in one transaction, with fresh
// event ids, and records the ids once COMMIT succeeded. conn is the
// caller's, so callers may commit from goroutines of their own.
func (l *Ledger) Commit(ctx context.Context, conn *pgx.Conn, events []OutboxEvent) error {
	ids := make([]string, len(events))
	for i := range ids {
		ids[i] = NewUUID()
	}
	return l.CommitIDs(ctx, conn, ids, events)
}

// CommitIDs is Commit with the event ids chosen by the caller, who can then
// look for them when the commit's outcome is in doubt (the server crashed
// before answering COMMIT) and Record them if they did commit.
func (l *Ledger) CommitIDs(ctx context.Context, conn *pgx.Conn, ids []string, events []OutboxEvent) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	batch := &pgx.Batch{}
	for i, e := range events {
		var headers any
		if e.Headers != "" {
			headers = e.Headers
		}
		if l.prefix != "" {
			batch.Queue("INSERT INTO "+EmittedTable+" (event_id, aggregate_id) VALUES ($1, $2)", ids[i], e.AggregateID)
			batch.Queue(EmitSQL, l.prefix, ids[i], e.AggregateType, e.AggregateID, e.EventType, e.Payload, headers)
			continue
		}
		batch.Queue(`INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
			VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb)`, ids[i], e.AggregateType, e.AggregateID, e.EventType, e.Payload, headers)
	}
	if err := tx.SendBatch(ctx, batch).Close(); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	l.Record(ids, events)
	return nil
}

// EmitSQL emits one event as the writer library's Emit does, with
// parameters prefix, event_id, aggregate_type, aggregate_id, event_type,
// payload and headers (NULL for none).
const EmitSQL = `SELECT pg_logical_emit_message(true, $1, (jsonb_build_object(
	'event_id', $2::uuid, 'aggregate_type', $3::text, 'aggregate_id', $4::text, 'event_type', $5::text,
	'schema_version', 1, 'payload', $6::jsonb, 'occurred_at', now())
	|| CASE WHEN $7::jsonb IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('headers', $7::jsonb) END)::text)`

// CommitBulk commits n events of aggregateType in one INSERT ... SELECT,
// the way a batch job writes: one transaction spread over 1,000 aggregates
// with payloads of about 200 bytes. It records them in commit order, which
// within the statement is the generate_series order, and returns their ids.
func (l *Ledger) CommitBulk(ctx context.Context, conn *pgx.Conn, aggregateType string, n int) ([]string, error) {
	rows, err := conn.Query(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
		SELECT gen_random_uuid(), $1, 'agg-' || (i % 1000), 'Bulk', jsonb_build_object('i', i, 'pad', repeat('p', 200))
		FROM generate_series(1, $2::int) AS i
		RETURNING event_id::text, aggregate_id, (payload->>'i')::int`, aggregateType, n)
	if err != nil {
		return nil, fmt.Errorf("bulk insert: %w", err)
	}
	type row struct {
		id, aggregate string
		seq           int
	}
	inserted, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		return x, r.Scan(&x.id, &x.aggregate, &x.seq)
	})
	if err != nil {
		return nil, fmt.Errorf("bulk insert: %w", err)
	}
	slices.SortFunc(inserted, func(a, b row) int { return a.seq - b.seq })
	ids := make([]string, len(inserted))
	events := make([]OutboxEvent, len(inserted))
	for i, r := range inserted {
		ids[i] = r.id
		events[i] = OutboxEvent{AggregateType: aggregateType, AggregateID: r.aggregate, EventType: "Bulk"}
	}
	l.Record(ids, events)
	return ids, nil
}

// Record notes events committed some other way (ids[i] is events[i]'s id),
// after everything recorded so far.
func (l *Ledger) Record(ids []string, events []OutboxEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, e := range events {
		l.index[ids[i]] = len(l.ids)
		l.ids = append(l.ids, ids[i])
		l.commitOrder[e.AggregateID] = append(l.commitOrder[e.AggregateID], ids[i])
	}
}

// Forget drops events from what the test expects in Kafka, for events it
// knows cannot arrive.
func (l *Ledger) Forget(ids []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	drop := map[string]bool{}
	for _, id := range ids {
		drop[id] = true
	}
	kept := l.ids[:0]
	l.index = map[string]int{}
	for _, id := range l.ids {
		if !drop[id] {
			l.index[id] = len(kept)
			kept = append(kept, id)
		}
	}
	l.ids = kept
	for agg, evs := range l.commitOrder {
		var k []string
		for _, id := range evs {
			if !drop[id] {
				k = append(k, id)
			}
		}
		l.commitOrder[agg] = k
	}
}

// Committed returns copies of the committed event ids in commit order and
// of the per-aggregate commit order (aggregate id -> event ids).
func (l *Ledger) Committed() (ids []string, commitOrder map[string][]string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	order := make(map[string][]string, len(l.commitOrder))
	for k, v := range l.commitOrder {
		order[k] = append([]string(nil), v...)
	}
	return append([]string(nil), l.ids...), order
}

// CommittedCount is how many events are committed.
func (l *Ledger) CommittedCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.ids)
}

// CommitIndex returns a copy of the map from each committed event id to
// its place in commit order.
func (l *Ledger) CommitIndex() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]int, len(l.index))
	for k, v := range l.index {
		out[k] = v
	}
	return out
}

// NewUUID returns a random (version 4) UUID in its text form.
func NewUUID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// PartitionedOutboxSQL is the relay's outbox table partitioned by created_at,
// as docs/partitioned-outbox.md describes: the primary key holds the partition key,
// and retention can drop old partitions whole. Partition outbox_events_old
// takes rows created before 2000, outbox_events_new the rest.
const PartitionedOutboxSQL = `
CREATE TABLE public.outbox_events (
	event_id       uuid        NOT NULL,
	aggregate_type text        NOT NULL,
	aggregate_id   text        NOT NULL,
	event_type     text        NOT NULL,
	schema_version int         NOT NULL DEFAULT 1,
	payload        jsonb       NOT NULL,
	headers        jsonb,
	occurred_at    timestamptz NOT NULL DEFAULT now(),
	created_at     timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (event_id, created_at)
) PARTITION BY RANGE (created_at);
CREATE TABLE public.outbox_events_old PARTITION OF public.outbox_events FOR VALUES FROM (MINVALUE) TO ('2000-01-01');
CREATE TABLE public.outbox_events_new PARTITION OF public.outbox_events FOR VALUES FROM ('2000-01-01') TO (MAXVALUE)`

// InsertIntoPartitions commits one event into each partition and returns
// their ids.
func InsertIntoPartitions(t testing.TB, db *PGDatabase, aggType string) []string {
	t.Helper()
	old, recent := NewUUID(), NewUUID()
	db.Exec(t, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, created_at)
		VALUES ($1, $3, 'a-1', 'Happened', '{"n": 1}', '1999-06-01T00:00:00Z'), ($2, $3, 'a-2', 'Happened', '{"n": 2}', now())`, old, recent, aggType)
	if n := db.QueryInt64(t, "SELECT count(*) FROM outbox_events_old WHERE event_id = $1", old); n != 1 {
		t.Fatalf("the old event is not in partition outbox_events_old")
	}
	return []string{old, recent}
}
