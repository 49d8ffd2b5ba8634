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

// setup is a database of the test's own with the inbox tables and a
// connection to it.
func setup(t *testing.T) (*harness.PGDatabase, *pgx.Conn) {
	t.Helper()
	db := pg.CreateTestDatabase(t)
	if err := createTables(db.DSN()); err != nil {
		t.Fatal(err)
	}
	return db, db.Connect(t)
}

func newInbox(t *testing.T, cfg inbox.Config) *inbox.Inbox {
	t.Helper()
	if cfg.Consumer == "" {
		cfg.Consumer = "billing"
	}
	ib, err := inbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return ib
}

// recordEffect is the side effect of the tests' handlers: one row per
// application.
func recordEffect(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, aggregate_id, version) VALUES ($1, $2, $3)`,
		ev.ID, ev.AggregateID, ev.Version)
	return err
}

func ev(id, agg string, version int64) inbox.Event {
	return inbox.Event{ID: id, AggregateType: "account", AggregateID: agg, EventType: "Credited", Version: version,
		Payload: []byte(`{}`), Headers: map[string]string{"event_id": id}}
}

func mustHandle(t *testing.T, ib *inbox.Inbox, conn *pgx.Conn, e inbox.Event) inbox.Result {
	t.Helper()
	res, err := ib.Handle(context.Background(), conn, e, recordEffect)
	if err != nil {
		t.Fatalf("handle %s: %v", e.ID, err)
	}
	return res
}

// effects lists the applied event IDs in the order they were applied.
func effects(t *testing.T, db *harness.PGDatabase) string {
	t.Helper()
	return db.QueryString(t, `SELECT COALESCE(string_agg(event_id, ',' ORDER BY seq), '') FROM effects`)
}

// A re-delivered event is recorded already: the handler does not run again
// and the skip is counted.
func TestInboxDuplicateIsANoOp(t *testing.T) {
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{})
	if r := mustHandle(t, ib, conn, ev("e1", "a", 0)); r.Outcome != inbox.Applied {
		t.Fatalf("first delivery: %v", r.Outcome)
	}
	if r := mustHandle(t, ib, conn, ev("e1", "a", 0)); r.Outcome != inbox.Duplicate {
		t.Fatalf("second delivery: %v, want duplicate", r.Outcome)
	}
	// Another consumer of the same events applies it once of its own.
	other := newInbox(t, inbox.Config{Consumer: "shipping"})
	if r := mustHandle(t, other, conn, ev("e1", "a", 0)); r.Outcome != inbox.Applied {
		t.Fatalf("another consumer: %v, want applied", r.Outcome)
	}
	if got := effects(t, db); got != "e1,e1" {
		t.Errorf("effects %q, want one per consumer", got)
	}
	if c := ib.Metrics().Counts(); c.Applied != 1 || c.Duplicates != 1 {
		t.Errorf("counts %+v, want 1 applied and 1 duplicate", c)
	}
}

// Two deliveries of one event handled at the same moment (a rebalance hands
// the partition over while the old owner still works) apply it once: the
// second waits on the first's record and then finds it.
func TestInboxConcurrentDeliveriesApplyOnce(t *testing.T) {
	db, _ := setup(t)
	ib := newInbox(t, inbox.Config{})
	const n = 8
	outcomes := make([]inbox.Outcome, n)
	errs := make([]error, n)
	conns := make([]*pgx.Conn, n)
	for i := range conns {
		conns[i] = db.Connect(t)
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			r, err := ib.Handle(context.Background(), conns[i], ev("same", "a", 0), recordEffect)
			outcomes[i], errs[i] = r.Outcome, err
		})
	}
	wg.Wait()
	applied := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("delivery %d: %v", i, errs[i])
		}
		if outcomes[i] == inbox.Applied {
			applied++
		}
	}
	if applied != 1 || effects(t, db) != "same" {
		t.Fatalf("%d deliveries applied, effects %q; want exactly one", applied, effects(t, db))
	}
}

// A handler error rolls back the record with the effect, so the event is
// applied when it comes again.
func TestInboxHandlerErrorRollsBackRecordAndEffect(t *testing.T) {
	ctx := context.Background()
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{})
	boom := errors.New("downstream refused")
	_, err := ib.Handle(ctx, conn, ev("e1", "a", 0), func(ctx context.Context, tx pgx.Tx, e inbox.Event) error {
		if err := recordEffect(ctx, tx, e); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("got %v, want the handler's error", err)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_processed`); n != 0 {
		t.Errorf("the failed event's record was kept (%d rows): a re-delivery would be skipped", n)
	}
	if got := effects(t, db); got != "" {
		t.Errorf("the failed event's effect was kept: %q", got)
	}
	if r := mustHandle(t, ib, conn, ev("e1", "a", 0)); r.Outcome != inbox.Applied {
		t.Fatalf("re-delivery after the error: %v, want applied", r.Outcome)
	}
	if c := ib.Metrics().Counts(); c.HandlerErrors != 1 || c.Applied != 1 {
		t.Errorf("counts %+v, want 1 handler error and 1 applied", c)
	}
}

// Versions: an applied version is a no-op, a gap is parked and applied
// right after its predecessor, in order, in the predecessor's transaction.
func TestInboxVersionAppliedAndGapHeld(t *testing.T) {
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{CheckVersions: true})
	mustHandle(t, ib, conn, ev("v1", "a", 1))
	mustHandle(t, ib, conn, ev("v2", "a", 2))
	// The same version under another event_id (the service wrote it
	// twice, or a replay): skipped, not applied.
	if r := mustHandle(t, ib, conn, ev("v2-again", "a", 2)); r.Outcome != inbox.Stale {
		t.Fatalf("an applied version: %v, want stale", r.Outcome)
	}
	if r := mustHandle(t, ib, conn, ev("v5", "a", 5)); r.Outcome != inbox.Parked {
		t.Fatalf("version 5 after 2: %v, want parked", r.Outcome)
	}
	if r := mustHandle(t, ib, conn, ev("v4", "a", 4)); r.Outcome != inbox.Parked {
		t.Fatalf("version 4 after 2: %v, want parked", r.Outcome)
	}
	// A re-delivery of a parked event is a duplicate.
	if r := mustHandle(t, ib, conn, ev("v4", "a", 4)); r.Outcome != inbox.Duplicate {
		t.Fatalf("parked event again: %v, want duplicate", r.Outcome)
	}
	// Another aggregate is not held up.
	mustHandle(t, ib, conn, ev("b1", "b", 1))
	if got := effects(t, db); got != "v1,v2,b1" {
		t.Fatalf("effects %q before the missing version came", got)
	}
	r := mustHandle(t, ib, conn, ev("v3", "a", 3))
	if r.Outcome != inbox.Applied || r.Released != 2 {
		t.Fatalf("version 3: %+v, want applied with 2 released", r)
	}
	if got := effects(t, db); got != "v1,v2,b1,v3,v4,v5" {
		t.Errorf("effects %q, want versions in order", got)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_parked`); n != 0 {
		t.Errorf("%d events still parked", n)
	}
	if v := db.QueryInt64(t, `SELECT version FROM inbox_versions WHERE aggregate_id = 'a'`); v != 5 {
		t.Errorf("stored version %d, want 5", v)
	}
	c := ib.Metrics().Counts()
	if c.Applied != 6 || c.StaleVersions != 1 || c.VersionGaps != 2 || c.Duplicates != 1 {
		t.Errorf("counts %+v, want 6 applied, 1 stale, 2 gaps, 1 duplicate", c)
	}
}

// With RefuseGaps a gap returns ErrVersionGap and records nothing, so the
// event is applied when it comes again after its predecessor.
func TestInboxVersionGapRefused(t *testing.T) {
	ctx := context.Background()
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{CheckVersions: true, Gaps: inbox.RefuseGaps})
	mustHandle(t, ib, conn, ev("v1", "a", 1))
	_, err := ib.Handle(ctx, conn, ev("v3", "a", 3), recordEffect)
	if !errors.Is(err, inbox.ErrVersionGap) || !strings.Contains(err.Error(), "version 3 arrived after version 1") {
		t.Fatalf("got %v, want ErrVersionGap naming both versions", err)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_processed WHERE event_id = 'v3'`); n != 0 {
		t.Fatalf("the refused event was recorded")
	}
	mustHandle(t, ib, conn, ev("v2", "a", 2))
	mustHandle(t, ib, conn, ev("v3", "a", 3))
	if got := effects(t, db); got != "v1,v2,v3" {
		t.Errorf("effects %q", got)
	}
	if c := ib.Metrics().Counts(); c.VersionGaps != 1 {
		t.Errorf("counts %+v, want 1 gap", c)
	}
}

// A predecessor missing for longer than the limit is reported: by the
// hook when another event of the aggregate arrives, and by Overdue, which
// also sets the gauge.
func TestInboxMissingPredecessorReported(t *testing.T) {
	ctx := context.Background()
	_, conn := setup(t)
	now := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	var reported []inbox.Missing
	ib := newInbox(t, inbox.Config{CheckVersions: true, MissingAfter: time.Minute,
		Now:                  func() time.Time { return now },
		OnMissingPredecessor: func(m inbox.Missing) { reported = append(reported, m) }})
	mustHandle(t, ib, conn, ev("v1", "a", 1))
	mustHandle(t, ib, conn, ev("v3", "a", 3))
	now = now.Add(30 * time.Second)
	mustHandle(t, ib, conn, ev("v4", "a", 4))
	if len(reported) != 0 {
		t.Fatalf("reported %+v within the limit", reported)
	}
	if m, err := ib.Overdue(ctx, conn); err != nil || len(m) != 0 {
		t.Fatalf("overdue within the limit: %+v, %v", m, err)
	}
	now = now.Add(31 * time.Second)
	mustHandle(t, ib, conn, ev("v5", "a", 5))
	want := inbox.Missing{AggregateType: "account", AggregateID: "a", Applied: 1, Waiting: 3, Since: now.Add(-61 * time.Second)}
	if len(reported) != 1 || !reported[0].Since.Equal(want.Since) || reported[0].Applied != 1 || reported[0].Waiting != 3 {
		t.Fatalf("reported %+v, want one report %+v", reported, want)
	}
	m, err := ib.Overdue(ctx, conn)
	if err != nil || len(m) != 1 || m[0].AggregateID != "a" || m[0].Waiting != 3 {
		t.Fatalf("overdue: %+v, %v", m, err)
	}
	if c := ib.Metrics().Counts(); c.MissingPredecessors != 1 || c.MissingReports != 1 {
		t.Errorf("counts %+v, want the gauge at 1 and one report", c)
	}
	mustHandle(t, ib, conn, ev("v2", "a", 2))
	if m, err := ib.Overdue(ctx, conn); err != nil || len(m) != 0 {
		t.Fatalf("overdue after the predecessor came: %+v, %v", m, err)
	}
}

// Prune refuses an age below the floor, and without a floor; above it, it
// deletes only this consumer's old records.
func TestInboxPruneKeepsTheFloor(t *testing.T) {
	ctx := context.Background()
	db, conn := setup(t)
	now := time.Now()
	ib := newInbox(t, inbox.Config{RetentionFloor: 7 * 24 * time.Hour, Now: func() time.Time { return now }})
	for i := range 3 {
		mustHandle(t, ib, conn, ev(fmt.Sprint("old", i), "a", 0))
	}
	mustHandle(t, newInbox(t, inbox.Config{Consumer: "other"}), conn, ev("old-other", "a", 0))
	db.Exec(t, `UPDATE inbox_processed SET processed_at = now() - interval '10 days'`)
	mustHandle(t, ib, conn, ev("new", "a", 0))

	if _, err := ib.Prune(ctx, conn, 24*time.Hour); err == nil || !strings.Contains(err.Error(), "below the retention floor") {
		t.Fatalf("prune below the floor: %v", err)
	}
	if _, err := newInbox(t, inbox.Config{}).Prune(ctx, conn, 30*24*time.Hour); err == nil || !strings.Contains(err.Error(), "RetentionFloor is not set") {
		t.Fatalf("prune without a floor: %v", err)
	}
	n, err := ib.Prune(ctx, conn, 8*24*time.Hour)
	if err != nil || n != 3 {
		t.Fatalf("prune: %d, %v; want 3 deleted", n, err)
	}
	if got := db.QueryString(t, `SELECT string_agg(consumer || '/' || event_id, ',' ORDER BY event_id) FROM inbox_processed`); got != "billing/new,other/old-other" {
		t.Errorf("left %q", got)
	}
}

// A second event with a version that is already parked (e3a v3 parked,
// then e3b v3 under another event_id) is the writer breaking its contract,
// as a second event with an applied version is: it is stale, counted as
// such, and never applied. It used to come back Parked, be counted as a
// gap and vanish in the parked table's ON CONFLICT DO NOTHING.
func TestInboxSecondEventWithAParkedVersionIsStale(t *testing.T) {
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{CheckVersions: true})
	mustHandle(t, ib, conn, ev("e1", "a", 1))
	if r := mustHandle(t, ib, conn, ev("e3a", "a", 3)); r.Outcome != inbox.Parked {
		t.Fatalf("version 3 after 1: %v, want parked", r.Outcome)
	}
	if r := mustHandle(t, ib, conn, ev("e3b", "a", 3)); r.Outcome != inbox.Stale {
		t.Fatalf("another event with the parked version 3: %v, want stale", r.Outcome)
	}
	r := mustHandle(t, ib, conn, ev("e2", "a", 2))
	if r.Outcome != inbox.Applied || r.Released != 1 {
		t.Fatalf("version 2: %+v, want applied with 1 released", r)
	}
	if got := effects(t, db); got != "e1,e2,e3a" {
		t.Errorf("effects %q, want e1,e2,e3a", got)
	}
	c := ib.Metrics().Counts()
	if c.Applied != 3 || c.StaleVersions != 1 || c.VersionGaps != 1 {
		t.Errorf("counts %+v, want 3 applied, 1 stale, 1 gap", c)
	}
}

// A hostile try: a consumer name with a NUL byte was accepted, and every
// record then failed for ever at the insert. It is refused at New.
func TestNewRefusesAConsumerNameTextCannotHold(t *testing.T) {
	for _, name := range []string{"bill\x00ing", "bill\xffing"} {
		if _, err := inbox.New(inbox.Config{Consumer: name}); err == nil || !strings.Contains(err.Error(), "plain text") {
			t.Errorf("consumer %q: %v, want a refusal", name, err)
		}
	}
}
