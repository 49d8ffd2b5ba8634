package poll_test

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/outbox-relay/outbox-relay/test/harness"
	"github.com/twmb/franz-go/pkg/kerr"
)

// snapshotFlags select the snapshot strategy.
var snapshotFlags = []string{"--poll-strategy", "snapshot"}

// newSnapEnv is newEnv with the outbox migrated for the snapshot strategy.
func newSnapEnv(t *testing.T) *env {
	t.Helper()
	return newSnapEnvOn(t, cluster.CreateTestDatabase(t))
}

func newSnapEnvOn(t *testing.T, db *harness.PGDatabase, migrate ...string) *env {
	t.Helper()
	e := &env{harness.NewEnv(t, db, "", partitions)}
	e.Source = "poll"
	e.Migrate(append(slices.Clone(snapshotFlags), migrate...)...)
	return e
}

// startSnapPoller starts a poller with the snapshot strategy and waits
// until it polls.
func (e *env) startSnapPoller(extra ...string) *harness.Process {
	e.T.Helper()
	return e.startPoller(append(slices.Clone(snapshotFlags), extra...)...)
}

// progressWrites is how many times the progress row was written, and the
// dead tuples the poller left in tables other than the outbox.
func (e *env) progressWrites() (updates, deadElsewhere int64) {
	e.T.Helper()
	// A backend reports its statistics at its exit at the latest: wait
	// for the poller's to end.
	harness.WaitFor(e.T, 30*time.Second, "the poller's sessions end", func() bool {
		return e.DB.QueryInt64(e.T, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'outbox-relay'") == 0
	})
	e.DB.Exec(e.T, "SELECT pg_stat_force_next_flush()")
	updates = e.DB.QueryInt64(e.T, "SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'outbox_events_poll_snapshot'")
	deadElsewhere = e.DB.QueryInt64(e.T, "SELECT coalesce(sum(n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables WHERE relname NOT IN ('outbox_events', 'outbox_events_poll_snapshot')")
	return updates, deadElsewhere
}

// The snapshot strategy delivers every event once, in per-aggregate order,
// with a backlog and with rows that come while it polls, and writes
// nothing per event: the progress row is updated once per page or window,
// and no other table changes.
func TestSnapshotDeliversEveryEventWithoutAWritePerEvent(t *testing.T) {
	e := newSnapEnv(t)
	conn := e.DB.Connect(t)
	e.writeEvents(conn, 100, 5, 7) // a backlog: 500 events, 5 pages of 100
	p := e.startSnapPoller("--poll-batch", "100")
	e.writeEvents(conn, 100, 2, 7) // while it polls: woken by NOTIFY
	records := e.ConsumeAll(time.Minute)
	if len(records) != e.CommittedCount() {
		t.Errorf("%d records for %d events: a poller alone on a table must publish each once", len(records), e.CommittedCount())
	}
	if code, err := p.Stop(30 * time.Second); err != nil || code != 0 {
		t.Fatalf("poller stopped with %d, %v:\n%s", code, err, p.Output())
	}
	updates, elsewhere := e.progressWrites()
	t.Logf("%d events, %d progress writes, %d rows changed in other tables", e.CommittedCount(), updates, elsewhere)
	if updates == 0 || updates > int64(e.CommittedCount())/2 {
		t.Errorf("%d writes of the progress row for %d events: want at least one, and far fewer than one per event", updates, e.CommittedCount())
	}
	if elsewhere != 0 {
		t.Errorf("%d rows updated or deleted outside the outbox and the progress row: the strategy must write nothing per event", elsewhere)
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_class WHERE relname = 'outbox_events_poll'"); n != 0 {
		t.Errorf("migrate --poll-strategy snapshot made the lease strategy's state table")
	}
}

// The visibility trap, as for the lease strategy: a transaction inserts an
// event, so takes a lower sequence number, and commits after a later
// event was published. A high-water mark would skip it; the snapshot
// strategy publishes it in the window in which it becomes visible.
func TestSnapshotLateCommitIsPublished(t *testing.T) {
	e := newSnapEnv(t)
	ctx := context.Background()
	e.startSnapPoller()
	lateID, laterID := harness.NewUUID(), harness.NewUUID()
	late, err := e.DB.Connect(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	insert := `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'Late', '{}')`
	if _, err := late.Exec(ctx, insert, lateID, "agg-late"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.DB.Connect(t).Exec(ctx, insert, laterID, "agg-other"); err != nil {
		t.Fatal(err)
	}
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{laterID}, time.Minute)
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{laterID, lateID}, time.Minute)
	if len(records) != 2 {
		t.Errorf("%d records for 2 events", len(records))
	}
}

// A transaction left open for long holds back nobody: the events other
// transactions commit meanwhile are published within seconds, the gauge
// shows how long it has been open, and its own event is published once it
// commits. (A high-water-mark poller must wait for it, or skip it.)
func TestSnapshotLongTransactionDelaysNoOtherEvent(t *testing.T) {
	e := newSnapEnv(t)
	ctx := context.Background()
	p := e.startSnapPoller("--poll-interval", "200ms")
	longID := harness.NewUUID()
	long, err := e.DB.Connect(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Rollback(ctx)
	if _, err := long.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'agg-long', 'Long', '{}')`, longID); err != nil {
		t.Fatal(err)
	}
	openedAt := time.Now()
	conn := e.DB.Connect(t)
	var worst time.Duration
	for i := 0; i < 20; i++ {
		id := harness.NewUUID()
		committed := time.Now()
		if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'Other', '{}')`,
			id, fmt.Sprintf("agg-%d", i)); err != nil {
			t.Fatal(err)
		}
		harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{id}, time.Minute)
		worst = max(worst, time.Since(committed))
	}
	harness.WaitFor(t, 30*time.Second, "the gauge shows the open transaction", func() bool {
		return harness.Metric(t, p.AdminURL(t), "outbox_relay_poll_snapshot_oldest_open_transaction_seconds") > 0
	})
	open := time.Since(openedAt)
	if err := long.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{longID}, time.Minute)
	t.Logf("with a transaction open for %v, the slowest of 20 other events took %v from commit to Kafka (read back)", open.Round(time.Millisecond), worst.Round(time.Millisecond))
	if worst > 10*time.Second {
		t.Errorf("an event committed beside an open transaction took %v to reach Kafka: the open transaction held it back", worst)
	}
}

// Subtransactions and prepared transactions: a row inserted in a savepoint
// that was rolled back is never published, one in a released savepoint
// is; a prepared transaction's rows are published once COMMIT PREPARED
// makes them visible, never if it is rolled back, and other events flow
// while it waits.
//
// PostgreSQL refuses PREPARE TRANSACTION after a NOTIFY, so writers that
// prepare need the outbox migrated without the NOTIFY trigger; the poller
// then looks every --poll-interval. The first PREPARE shows why.
func TestSnapshotSubtransactionsAndPreparedTransactions(t *testing.T) {
	ctx := context.Background()
	notifying := newSnapEnv(t)
	tx, err := notifying.DB.Connect(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'a', 'E', '{}')`, harness.NewUUID()); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "PREPARE TRANSACTION 'outbox_relay_test_notified'"); err == nil || !strings.Contains(err.Error(), "NOTIFY") {
		t.Fatalf("PREPARE TRANSACTION after an insert into an outbox with the NOTIFY trigger: %v, want PostgreSQL's refusal naming NOTIFY", err)
	}

	e := newSnapEnvOn(t, cluster.CreateTestDatabase(t), "--poll-notify=false")
	e.startSnapPoller("--poll-notify=false", "--poll-interval", "100ms")
	insert := `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'E', '{}')`
	kept, undone, inPrepared, inAborted, beside := harness.NewUUID(), harness.NewUUID(), harness.NewUUID(), harness.NewUUID(), harness.NewUUID()

	conn := e.DB.Connect(t)
	for _, stmt := range []struct {
		sql  string
		args []any
	}{
		{"BEGIN", nil},
		{"SAVEPOINT a", nil},
		{insert, []any{kept, "agg-sub"}},
		{"RELEASE SAVEPOINT a", nil},
		{"SAVEPOINT b", nil},
		{insert, []any{undone, "agg-sub"}},
		{"ROLLBACK TO SAVEPOINT b", nil},
		{"COMMIT", nil},
		{"BEGIN", nil},
		{insert, []any{inPrepared, "agg-prepared"}},
		{"PREPARE TRANSACTION 'outbox_relay_test_commit'", nil},
		{"BEGIN", nil},
		{insert, []any{inAborted, "agg-prepared"}},
		{"PREPARE TRANSACTION 'outbox_relay_test_abort'", nil},
	} {
		if _, err := conn.Exec(ctx, stmt.sql, stmt.args...); err != nil {
			t.Fatalf("%s: %v", stmt.sql, err)
		}
	}
	if _, err := conn.Exec(ctx, insert, beside, "agg-beside"); err != nil {
		t.Fatal(err)
	}
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{kept, beside}, time.Minute)
	e.DB.Exec(t, "COMMIT PREPARED 'outbox_relay_test_commit'")
	e.DB.Exec(t, "ROLLBACK PREPARED 'outbox_relay_test_abort'")
	after := harness.NewUUID()
	if _, err := conn.Exec(ctx, insert, after, "agg-after"); err != nil {
		t.Fatal(err)
	}
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{kept, beside, inPrepared, after}, time.Minute)
	for _, r := range records {
		if id := r.EventID(); id == undone || id == inAborted {
			t.Errorf("event %s of a rolled-back subtransaction or prepared transaction was published", id)
		}
	}
	if len(records) != 4 {
		t.Errorf("%d records for 4 events", len(records))
	}
}

// The rows already in the outbox when migrate adds the strategy are
// published first, oldest first, once (--poll-existing pending, the
// default); with --poll-existing published they are not.
func TestSnapshotMigratePublishesExistingRows(t *testing.T) {
	for _, existing := range []string{"pending", "published"} {
		t.Run(existing, func(t *testing.T) {
			db := cluster.CreateTestDatabase(t)
			before := &env{harness.NewEnv(t, db, "", partitions)}
			before.Source = "poll"
			before.Migrate() // the lease strategy's schema, then its trigger goes
			db.Exec(t, "DROP TRIGGER outbox_events_poll_track ON outbox_events")
			before.writeEvents(db.Connect(t), 30, 3, 5)
			existingIDs, _ := before.Committed()

			e := newSnapEnvOn(t, db, "--poll-existing", existing)
			e.Ledger = before.Ledger
			e.startSnapPoller("--poll-batch", "20")
			e.writeEvents(db.Connect(t), 10, 2, 5)
			if existing == "pending" {
				records := e.ConsumeAll(time.Minute)
				if len(records) != e.CommittedCount() {
					t.Errorf("%d records for %d events", len(records), e.CommittedCount())
				}
				return
			}
			newIDs, _ := e.Committed()
			newIDs = slices.DeleteFunc(newIDs, func(id string) bool { return slices.Contains(existingIDs, id) })
			records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, newIDs, time.Minute)
			for _, r := range records {
				if slices.Contains(existingIDs, r.EventID()) {
					t.Fatalf("event %s, in the outbox before migrate --poll-existing published, was published", r.EventID())
				}
			}
		})
	}
}

// An event Kafka keeps refusing with a retriable error ends its page's
// session at each attempt; at its --max-attempts-th attempt it goes to the
// quarantine table with that count, the other aggregate's event beside it
// is published, and the line moves on.
func TestSnapshotRetriableFailuresQuarantineAtMaxAttempts(t *testing.T) {
	e := newSnapEnv(t)
	fault := e.Kafka.FailProduceTo("outbox.event.flaky", -1, kerr.NotEnoughReplicas.Code)
	defer fault.Remove()
	poller := e.startSnapPoller("--max-attempts", "3")
	conn := e.DB.Connect(t)
	if err := e.Commit(context.Background(), conn, []harness.OutboxEvent{
		{AggregateType: "flaky", AggregateID: "f-1", EventType: "Tried", Payload: `{}`},
		{AggregateType: "steady", AggregateID: "s-1", EventType: "Tried", Payload: `{}`},
	}); err != nil {
		t.Fatal(err)
	}
	ids, _ := e.Committed()
	harness.WaitFor(t, time.Minute, "the flaky event is quarantined after its attempts", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE event_id = $1 AND error_class = 'retriable'", ids[0]) == 1
	})
	e.checkQuarantineAttempts(poller, ids[0], 3)
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.steady$`, ids[1:], time.Minute)
	later := harness.NewUUID()
	if _, err := conn.Exec(context.Background(), `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'steady', 's-2', 'After', '{}')`, later); err != nil {
		t.Fatal(err)
	}
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.steady$`, []string{ids[1], later}, time.Minute)
}

// A second poller of the table waits as a standby, and takes over once the
// first is SIGKILLed: every event is published, and the killed poller's
// unstored page at most is published twice.
func TestSnapshotStandbyTakesOverAfterKill(t *testing.T) {
	e := newSnapEnv(t)
	conn := e.DB.Connect(t)
	first := e.startSnapPoller("--poll-batch", "50")
	second := harness.StartProcess(t, e.Bin, e.pollArgs(append(slices.Clone(snapshotFlags), "--poll-batch", "50")...), []string{harness.LogLevelInfo})
	second.WaitForOutput(t, "waiting as its standby", time.Minute)
	e.writeEvents(conn, 40, 5, 9)
	harness.WaitFor(t, time.Minute, "the first poller publishes", func() bool {
		return harness.Metric(t, first.AdminURL(t), "outbox_relay_poll_rows_claimed_total") > 0
	})
	first.Kill()
	second.WaitForOutput(t, `"message":"polling"`, time.Minute)
	e.writeEvents(conn, 40, 5, 9)
	records := e.ConsumeAll(time.Minute)
	dups := len(records) - e.CommittedCount()
	t.Logf("%d events, %d records (%d published twice after the kill)", e.CommittedCount(), len(records), dups)
	if dups > 50 {
		t.Errorf("%d duplicates after one kill: over one page (50)", dups)
	}
}

// Retention deletes only rows the stored progress covers: with Kafka
// holding the poller's records, the unpublished rows stay; once they are
// published, they go.
func TestSnapshotRetentionDeletesOnlyPublishedRows(t *testing.T) {
	e := newSnapEnv(t)
	conn := e.DB.Connect(t)
	admin := e.startSnapPoller("--retention", "1ms", "--retention-interval", "100ms").AdminURL(t)
	e.writeEvents(conn, 5, 2, 2)
	e.ConsumeAll(time.Minute)
	harness.WaitFor(t, 30*time.Second, "retention deletes the published rows", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events") == 0
	})
	release := e.Kafka.HoldProduce()
	defer release()
	e.writeEvents(conn, 3, 2, 1)
	harness.WaitFor(t, 30*time.Second, "the held records reach the broker", func() bool { return e.Kafka.HeldProduces() > 0 })
	runs := harness.Metric(t, admin, "outbox_relay_retention_runs_total")
	harness.WaitFor(t, 30*time.Second, "three more retention passes", func() bool {
		return harness.Metric(t, admin, "outbox_relay_retention_runs_total") >= runs+3
	})
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events"); n != 6 {
		t.Fatalf("%d of 6 unpublished rows left after retention passes: retention deleted rows the progress does not cover", n)
	}
	release()
	e.ConsumeAll(time.Minute)
	harness.WaitFor(t, 30*time.Second, "retention deletes the rows once published", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events") == 0
	})
}

// migrate --poll-strategy snapshot works on an outbox partitioned by its
// insert time, and `status` reports the progress.
func TestSnapshotPartitionedOutboxAndStatus(t *testing.T) {
	db := cluster.CreateTestDatabase(t)
	db.Exec(t, harness.PartitionedOutboxSQL)
	e := newSnapEnvOn(t, db)
	e.startSnapPoller()
	ids := harness.InsertIntoPartitions(t, db, "order")
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.order$`, ids, time.Minute)
	harness.WaitFor(t, 30*time.Second, "status reports nothing pending", func() bool {
		code, out := harness.RunCommand(t, e.Bin, append([]string{"status", "--source", "poll", "--pg-dsn", db.DSN()}, snapshotFlags...))
		return code == 0 && strings.Contains(out, `"pending_rows": 0`) && strings.Contains(out, `"strategy": "snapshot"`)
	})
}

// A poller given both servers follows a promotion: the primary stops with
// -m immediate mid-stream, its synchronous standby (which holds every
// committed row and the progress row) is promoted, and the poller goes on
// from the stored progress there. The old primary's open transactions are
// aborted on the new one, so the window that lists them never publishes
// them; every committed event arrives, re-delivery bounded by one page.
func TestSnapshotFollowsAPromotion(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{})
	standby := pg.CopyStandby(t, "snapshot_standby", nil)
	pg.Exec(t, "ALTER SYSTEM SET synchronous_standby_names = 'snapshot_standby'")
	pg.Exec(t, "SELECT pg_reload_conf()")
	db := pg.CreateTestDatabase(t)
	e := newSnapEnvOn(t, db)
	both := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/%s?target_session_attrs=read-write", pg.Port(), standby.Port(), db.Name())
	p := harness.StartProcess(t, e.Bin, append(e.pollArgs(append(slices.Clone(snapshotFlags), "--poll-batch", "50")...), "--pg-dsn", both), []string{harness.LogLevelInfo})
	p.WaitForOutput(t, `"message":"polling"`, time.Minute)

	e.writeEvents(db.Connect(t), 60, 3, 11)
	pg.StopImmediate(t)
	standby.Promote(t)
	conn, err := pgx.Connect(context.Background(), standby.DSN(db.Name()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	e.writeEvents(conn, 60, 3, 11)
	records := e.ConsumeAll(2 * time.Minute)
	dups := len(records) - e.CommittedCount()
	t.Logf("%d events, %d records across the promotion (%d published twice)", e.CommittedCount(), len(records), dups)
	if dups > 50 {
		t.Errorf("%d duplicates across a promotion: over one page (50)", dups)
	}
	if p.Exited() {
		t.Errorf("the poller exited at the promotion:\n%s", harness.LastLines(p.Output(), 20))
	}
}

// The lease drills' kills, with the snapshot strategy: two pollers (one
// active, one standby) while a writer commits across 300 aggregates; once
// with the active poller's page in flight (Kafka holds its produce
// requests), then at random moments, the active poller is SIGKILLed and
// restarted as the new standby. Every committed event arrives, first
// deliveries in per-aggregate order, and each kill re-delivers at most the
// page it had in flight.
func TestDrillSnapshotPollersKilled(t *testing.T) {
	w := &world{env: newSnapEnv(t), rng: mrand.New(mrand.NewPCG(harness.DrillSeed(t), 0))}
	start := func() *harness.Process {
		args := w.pollArgs(append(slices.Clone(snapshotFlags), "--poll-batch", fmt.Sprint(drillBatch))...)
		return harness.StartProcess(t, w.Bin, args, []string{harness.LogLevelInfo})
	}
	polling := func(p *harness.Process) bool { return strings.Contains(p.Output(), `"message":"polling"`) }
	pollers := []*harness.Process{start()}
	pollers[0].WaitForOutput(t, `"message":"polling"`, time.Minute)
	pollers = append(pollers, start())
	pollers[1].WaitForOutput(t, "waiting as its standby", time.Minute)
	wr := w.startWriter(w.DB.DSN(), 5*time.Millisecond, 300)

	// kill SIGKILLs the active poller, waits for the standby to take over,
	// and starts the killed one again as the new standby.
	kills := 0
	kill := func(before func() (after func())) {
		active := slices.IndexFunc(pollers, polling)
		if active < 0 {
			t.Fatal("no poller is polling")
		}
		after := func() {}
		if before != nil {
			after = before()
		}
		pollers[active].Kill()
		after()
		kills++
		other := 1 - active
		pollers[other].WaitForOutput(t, `"message":"polling"`, time.Minute)
		pollers[active] = start()
		pollers[active].WaitForOutput(t, "waiting as its standby", time.Minute)
	}
	harness.WaitFor(t, time.Minute, "events flow", func() bool { return w.CommittedCount() > 500 })
	kill(func() func() {
		release := w.Kafka.HoldProduce()
		harness.WaitFor(t, time.Minute, "the active poller's page waits for Kafka", func() bool { return w.Kafka.HeldProduces() > 0 })
		return release // after the kill: the page was in flight when its poller died
	})
	for range harness.Sized(4, 15) {
		time.Sleep(time.Duration(300+w.rng.IntN(1200)) * time.Millisecond) // the drill's random gap between kills: a load shape, not a wait for anything
		kill(nil)
	}
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	records := w.ConsumeAll(3 * time.Minute)
	dups := len(records) - w.CommittedCount()
	t.Logf("%d events, %d records (%d duplicates, bound %d) after %d kills", w.CommittedCount(), len(records), dups, kills*drillBatch, kills)
	if dups > kills*drillBatch {
		t.Errorf("%d duplicates after %d kills: over one page (%d) per kill", dups, kills, drillBatch)
	}
	for i, p := range pollers {
		if p.Exited() {
			t.Errorf("poller %d exited:\n%s", i, harness.LastLines(p.Output(), 20))
		}
	}
}

// Transaction ids are 64-bit (xid8: the 32-bit id and its epoch), so the
// strategy's windows never wrap around. Here the window straddles the
// 32-bit boundary: rows committed with epoch 0 while no poller runs, then
// pg_resetwal moves the epoch on (as 2^32 transactions would), more rows
// are committed with epoch 1, and a poller started on the stored progress
// publishes both sides in order.
func TestSnapshotWindowAcrossTheEpoch(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{})
	db := pg.CreateTestDatabase(t)
	e := newSnapEnvOn(t, db)
	e.startSnapPoller().Stop(30 * time.Second)
	e.writeEvents(db.Connect(t), 20, 3, 5)
	before := db.QueryString(t, "SELECT max(outbox_relay_xid)::text FROM outbox_events")
	pg.Stop(t)
	pg.ResetWAL(t, "-e", "1")
	pg.Start(t)
	e.writeEvents(db.Connect(t), 20, 3, 5)
	after := db.QueryString(t, "SELECT max(outbox_relay_xid)::text FROM outbox_events")
	if db.QueryInt64(t, "SELECT count(*) FROM outbox_events WHERE outbox_relay_xid >= '4294967296'::xid8") == 0 {
		t.Fatalf("no row has an epoch-1 transaction id after pg_resetwal -e 1 (last %s, before %s)", after, before)
	}
	e.startSnapPoller()
	records := e.ConsumeAll(time.Minute)
	t.Logf("%d events across the epoch (transaction ids up to %s, then from 2^32 to %s), %d records", e.CommittedCount(), before, after, len(records))
	if len(records) != e.CommittedCount() {
		t.Errorf("%d records for %d events", len(records), e.CommittedCount())
	}
}

// A window with rows is stored as done as soon as its last page is acked.
// When its rows filled its last page exactly (2,000 rows in pages of 500
// here, as the benchmark's backlogs do), the read that finds it ended
// returns no rows, and its end was stored with the empty windows, at most
// every 10 s; until then the stored progress was the one from before the
// window, and every row of it, all published, counted as pending (the
// gauges, `status`).
func TestSnapshotStoresAWindowsEndAtOnce(t *testing.T) {
	e := newSnapEnv(t)
	conn := e.DB.Connect(t)
	if _, err := e.CommitBulk(context.Background(), conn, "order", 2000); err != nil {
		t.Fatal(err)
	}
	e.startSnapPoller("--poll-batch", "500")
	e.ConsumeAll(time.Minute)
	harness.WaitFor(t, 5*time.Second, "the finished window's end stored (less than the 10 s between stores of empty windows)", func() bool {
		return e.DB.QueryString(t, "SELECT (window_end IS NULL)::text FROM outbox_events_poll_snapshot") == "true"
	})
	code, out := harness.RunCommand(t, e.Bin, []string{"status", "--source", "poll", "--poll-strategy", "snapshot", "--pg-dsn", e.DB.DSN()})
	if code != 0 || !strings.Contains(out, `"pending_rows": 0`) {
		t.Errorf("status exited %d, want 0 pending rows once everything is published:\n%s", code, out)
	}
}
