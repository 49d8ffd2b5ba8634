package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// isoBeginner begins each transaction at one isolation level, as a
// service whose database or role sets default_transaction_isolation does.
type isoBeginner struct {
	conn *pgx.Conn
	iso  pgx.TxIsoLevel
}

func (b isoBeginner) Begin(ctx context.Context) (pgx.Tx, error) {
	return b.conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: b.iso})
}

// A parked event was never released when its predecessor's transaction
// had waited on the lock of the transaction that parked it (issue 55,
// item 1). Aggregate a is at version 2. Batch P2 = [a v4, b v1] parks v4
// and holds a's version lock while b's handler runs; batch P1 = [a v3]
// starts meanwhile and waits for that lock. The statement that waited
// re-read a's version row after the wait, but its EXISTS on the parked
// table kept the snapshot from before it, saw nothing parked, and v3 was
// applied without releasing v4: a stayed at v3 with v4 parked for ever, a
// later v5 parked too, and a re-delivered v4 was counted a duplicate.
// Under READ COMMITTED the check now runs in a statement of its own after
// the lock; under REPEATABLE READ (whose snapshot is the transaction's)
// the parking transaction writes the version row, so the waiter fails
// with a serialization error and its retry sees the parked event.
func TestInboxParkedEventReleasedAfterALockWait(t *testing.T) {
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			ctx := context.Background()
			db, conn := setup(t)
			ib := newInbox(t, inbox.Config{CheckVersions: true})
			mustHandle(t, ib, conn, ev("a1", "a", 1))
			mustHandle(t, ib, conn, ev("a2", "a", 2))

			holding, release := make(chan struct{}), make(chan struct{})
			slowB := func(ctx context.Context, tx pgx.Tx, e inbox.Event) error {
				if e.ID == "b1" {
					close(holding)
					<-release
				}
				return recordEffect(ctx, tx, e)
			}
			p2 := isoBeginner{db.Connect(t), iso}
			p2Done := make(chan error, 1)
			go func() {
				res, err := ib.HandleBatch(ctx, p2, []inbox.Event{ev("a4", "a", 4), ev("b1", "b", 1)}, slowB)
				if err == nil && (res[0].Outcome != inbox.Parked || res[1].Outcome != inbox.Applied) {
					err = fmt.Errorf("P2 results %v, want parked and applied", res)
				}
				p2Done <- err
			}()
			<-holding

			p1 := isoBeginner{db.Connect(t), iso}
			p1Done := make(chan error, 1)
			go func() {
				// As an adapter does: retried until applied, so a
				// serialization failure is one more attempt.
				p1Done <- ib.ApplyInOrder(ctx, p1, inbox.Records{Len: 1,
					Parse:   func(int) (inbox.Event, error) { return ev("a3", "a", 3), nil },
					Applied: func(int, int) {},
				}, func(ctx context.Context, tx pgx.Tx, e inbox.Event) error {
					return recordEffect(ctx, tx, e)
				}, 10*time.Millisecond)
			}()
			harness.WaitFor(t, 30*time.Second, "P1 waits for a's version lock", func() bool {
				return db.QueryInt64(t, `SELECT count(*) FROM pg_stat_activity
					WHERE wait_event_type = 'Lock' AND datname = current_database()`) == 1
			})
			close(release)
			if err := <-p2Done; err != nil {
				t.Fatalf("P2: %v", err)
			}
			if err := <-p1Done; err != nil {
				t.Fatalf("P1: %v", err)
			}
			if v := db.QueryInt64(t, `SELECT version FROM inbox_versions WHERE aggregate_id = 'a'`); v != 4 {
				t.Errorf("a's version %d after v3, want 4 (v4 released with it)", v)
			}
			if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_parked`); n != 0 {
				t.Errorf("%d events still parked", n)
			}
			if r := mustHandle(t, ib, conn, ev("a5", "a", 5)); r.Outcome != inbox.Applied {
				t.Errorf("a v5 afterwards: %v, want applied", r.Outcome)
			}
			if got := effects(t, db); got != "a1,a2,b1,a3,a4,a5" {
				t.Errorf("effects %q, want a1,a2,b1,a3,a4,a5", got)
			}
		})
	}
}

// A handler that commits the transaction it was given lost the rest of
// its batch without a word (issue 55, item 5): batch c1..c4, the handler
// committed on c2; HandleBatch returned four duplicates and no error,
// all four were recorded as processed, and only c1 and c2 took effect.
// Now tx.Commit and tx.Rollback inside a handler are refused, the event
// whose handler tried is named in the error, and nothing after it is
// recorded. The same through SQL (a COMMIT statement) is noticed after
// the handler returns: its event is named, and the records the COMMIT
// took with it for events whose handlers never ran are taken back.
func TestInboxHandlerThatEndsTheTransactionFails(t *testing.T) {
	// The chained forms, and ROLLBACK followed by a write, came from a
	// hostile try of the first fix: AND CHAIN leaves the connection in a
	// new transaction the status check cannot tell from the inbox's
	// (effects lost, or applied twice, and the batch reported applied),
	// and a write after ROLLBACK committed on its own.
	for _, how := range []string{"tx.Commit", "tx.Rollback", "COMMIT", "ROLLBACK", "ROLLBACK AND CHAIN", "COMMIT AND CHAIN",
		"rollback; begin", "ROLLBACK+write"} {
		for _, versions := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/versions=%v", how, versions), func(t *testing.T) {
				ctx := context.Background()
				db, conn := setup(t)
				ib := newInbox(t, inbox.Config{CheckVersions: versions})
				var batch []inbox.Event
				for i := 1; i <= 4; i++ {
					batch = append(batch, ev(fmt.Sprintf("c%d", i), "c", int64(i)))
				}
				misbehave := true
				h := func(ctx context.Context, tx pgx.Tx, e inbox.Event) error {
					if err := recordEffect(ctx, tx, e); err != nil {
						return err
					}
					if e.ID != "c2" || !misbehave {
						return nil
					}
					switch how {
					case "tx.Commit":
						_ = tx.Commit(ctx) // the error is ignored, as a careless handler does
					case "tx.Rollback":
						_ = tx.Rollback(ctx)
					case "ROLLBACK+write":
						_, _ = tx.Exec(ctx, "ROLLBACK")
						_ = recordEffect(ctx, tx, e)
					default:
						_, _ = tx.Exec(ctx, how)
					}
					return nil
				}
				res, err := ib.HandleBatch(ctx, conn, batch, h)
				if err == nil || !strings.Contains(err.Error(), "event c2") {
					t.Fatalf("HandleBatch: %v, %v; want an error naming c2", res, err)
				}
				for _, r := range res {
					if r.Outcome != inbox.Applied {
						t.Fatalf("results %v: only applied events may be reported", res)
					}
				}
				// The adapter hands in the rest again, as ApplyInOrder does.
				misbehave = false
				rest, err := ib.HandleBatch(ctx, conn, batch[len(res):], h)
				if err != nil {
					t.Fatalf("the rest again: %v", err)
				}
				applied := 0
				for _, r := range append(res, rest...) {
					if r.Outcome == inbox.Applied {
						applied++
					}
				}
				if got := db.QueryString(t, `SELECT string_agg(DISTINCT event_id, ',') FROM effects`); got != "c1,c2,c3,c4" {
					t.Errorf("effects of %q, want every event's", got)
				}
				if n := db.QueryInt64(t, `SELECT count(*) - count(DISTINCT event_id) FROM effects`); n != 0 {
					t.Errorf("%d events applied twice", n)
				}
				if versions {
					if v := db.QueryInt64(t, `SELECT version FROM inbox_versions WHERE aggregate_id = 'c'`); v != 4 {
						t.Errorf("version %d, want 4", v)
					}
					if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_parked`); n != 0 {
						t.Errorf("%d events parked", n)
					}
				}
				if c := ib.Metrics().Counts(); c.HandlerErrors < 1 {
					t.Errorf("counts %+v, want the handler's misuse counted as a handler error", c)
				}
			})
		}
	}
}

// A handler that swallowed an SQL error and returned nil left its
// transaction aborted, and the batch failed at its commit with "commit
// unexpectedly resulted in rollback" naming the batch's first event, not
// the one whose handler failed (issue 55, item 6). Now the handler's
// event is named, with what to do, and the events before it commit.
func TestInboxHandlerThatSwallowsAnSQLErrorIsNamed(t *testing.T) {
	ctx := context.Background()
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{})
	batch := []inbox.Event{ev("s1", "s", 0), ev("s2", "s", 0), ev("s3", "s", 0)}
	h := func(ctx context.Context, tx pgx.Tx, e inbox.Event) error {
		if e.ID == "s2" {
			_, _ = tx.Exec(ctx, `INSERT INTO no_such_table VALUES (1)`) // error ignored
			return nil
		}
		return recordEffect(ctx, tx, e)
	}
	res, err := ib.HandleBatch(ctx, conn, batch, h)
	if err == nil || !strings.Contains(err.Error(), "event s2") || !strings.Contains(err.Error(), "aborted") {
		t.Fatalf("HandleBatch: %v; want an error naming s2 and the aborted transaction", err)
	}
	if len(res) != 1 || effects(t, db) != "s1" {
		t.Fatalf("%d results, effects %q; want s1 applied", len(res), effects(t, db))
	}
	var he interface{ Unwrap() error }
	if !errors.As(err, &he) {
		t.Errorf("error %v does not wrap the cause", err)
	}
	if c := ib.Metrics().Counts(); c.HandlerErrors != 1 {
		t.Errorf("counts %+v, want 1 handler error", c)
	}
}

// A hostile try of the record-format switch (issue 55, item 4): a new
// aggregate's typed batch and untyped batch applied at once each missed
// the other's uncommitted version row and made its own, ('order', A) and
// (”, A), so every later version parked for ever (527 of 3,090 events in
// a run with partitions added and CloudEvents switched on). Rows of one
// aggregate id are now made under one lock. Under REPEATABLE READ the
// snapshot is older than the lock, so the race stays there (docs/inbox.md
// says so); SERIALIZABLE fails one of the two and applies it again.
func TestInboxNewAggregateTypedAndUntypedAtOnce(t *testing.T) {
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.Serializable} {
		for _, typedFirst := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/typed-first=%v", iso, typedFirst), func(t *testing.T) {
				ctx := context.Background()
				db, _ := setup(t)
				ib := newInbox(t, inbox.Config{CheckVersions: true})
				first, second := []inbox.Event{ev("a1", "a", 1)}, []inbox.Event{untyped("a2", "a", 2), untyped("a3", "a", 3)}
				if !typedFirst {
					first, second = []inbox.Event{untyped("a1", "a", 1)}, []inbox.Event{ev("a2", "a", 2), ev("a3", "a", 3)}
				}
				holding, release := make(chan struct{}), make(chan struct{})
				var held sync.Once
				slow := func(ctx context.Context, tx pgx.Tx, e inbox.Event) error {
					if e.ID == "a1" {
						held.Do(func() { close(holding) })
						<-release
					}
					return recordEffect(ctx, tx, e)
				}
				apply := func(conn inbox.Beginner, events []inbox.Event, h inbox.Handler, done chan<- error) {
					done <- ib.ApplyInOrder(ctx, conn, inbox.Records{Len: len(events),
						Parse:   func(i int) (inbox.Event, error) { return events[i], nil },
						Applied: func(int, int) {},
					}, h, 10*time.Millisecond)
				}
				firstDone, secondDone := make(chan error, 1), make(chan error, 1)
				go apply(isoBeginner{db.Connect(t), iso}, first, slow, firstDone)
				<-holding
				go apply(isoBeginner{db.Connect(t), iso}, second, slow, secondDone)
				harness.WaitFor(t, 30*time.Second, "the second batch waits, or is done", func() bool {
					return len(secondDone) > 0 || db.QueryInt64(t, `SELECT count(*) FROM pg_stat_activity
						WHERE wait_event_type = 'Lock' AND datname = current_database()`) == 1
				})
				close(release)
				for _, done := range []chan error{firstDone, secondDone} {
					if err := <-done; err != nil {
						t.Fatal(err)
					}
				}
				if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_parked`); n != 0 {
					t.Errorf("%d events parked for ever; version rows: %s", n,
						db.QueryString(t, `SELECT string_agg(format('(%L, %s)', aggregate_type, version), ' ') FROM inbox_versions`))
				}
				if got := effects(t, db); got != "a1,a2,a3" {
					t.Errorf("effects %q, want a1,a2,a3", got)
				}
			})
		}
	}
}

// A hostile try of the unparsable table: a second, different record that
// could not be read at a topic, partition and offset where one was set
// aside already (a topic deleted and made again starts its offsets anew)
// was taken for a re-delivery: not stored, not counted, not reported. A
// re-delivery of the same bytes is still stored once.
func TestInboxUnparsableRecordsAtOneOffsetAreKeptApart(t *testing.T) {
	ctx := context.Background()
	db, conn := setup(t)
	reported := 0
	ib := newInbox(t, inbox.Config{OnUnparsable: func(inbox.RawRecord, error) { reported++ }})
	setAside := func(value string) {
		t.Helper()
		raw := inbox.RawRecord{Topic: "rc", Partition: 0, Offset: 0, Value: []byte(value)}
		err := ib.ApplyInOrder(ctx, conn, inbox.Records{Len: 1,
			Parse:   func(int) (inbox.Event, error) { return inbox.ParseRecord(nil, nil, raw.Value) },
			Applied: func(int, int) {},
			Raw:     func(int) inbox.RawRecord { return raw },
		}, recordEffect, 10*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
	}
	setAside("first bad record")
	setAside("first bad record") // a re-delivery
	setAside("another bad record, after the topic was made again")
	if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_unparsable`); n != 2 {
		t.Errorf("%d records set aside, want the two different ones", n)
	}
	if reported != 2 || ib.Metrics().Counts().Unparsable != 2 {
		t.Errorf("reported %d, counted %d; want 2 and 2", reported, ib.Metrics().Counts().Unparsable)
	}
}
