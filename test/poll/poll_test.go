package poll_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// The basic promise: every committed event arrives once, in per-aggregate
// order, and its row is marked published.
func TestPollDeliversEveryEventInOrder(t *testing.T) {
	e := newEnv(t)
	conn := e.DB.Connect(t)
	e.writeEvents(conn, 50, 4, 7) // before the poller: a backlog
	p := e.startPoller()
	e.writeEvents(conn, 50, 4, 7) // while it polls: woken by NOTIFY
	records := e.ConsumeAll(time.Minute)
	if len(records) != e.CommittedCount() {
		t.Errorf("%d records for %d events: a poller alone on a table must publish each once", len(records), e.CommittedCount())
	}
	if code, err := p.Stop(30 * time.Second); err != nil || code != 0 {
		t.Fatalf("poller stopped with %d, %v:\n%s", code, err, p.Output())
	}
	if n := e.unpublished(); n != 0 {
		t.Errorf("%d state rows still unpublished after every event arrived", n)
	}
}

// The visibility trap: a transaction inserts an event, so takes a lower
// sequence number, and commits after events with higher numbers were
// published. A poller that remembers the highest number it saw skips that
// event for good; poll mode selects by state and publishes it.
//
// The first half runs a high-water-mark poller, written here, over the
// same interleaving, and asserts that it misses the event: the scenario
// can catch that design.
func TestPollVisibilityTrapLateCommitIsPublished(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()

	// A high-water-mark poller over the state table's sequence.
	hwm := int64(0)
	pollHWM := func() []string {
		rows, err := e.DB.Connect(t).Query(ctx, "SELECT seq, event_id::text FROM outbox_events_poll WHERE seq > $1 ORDER BY seq", hwm)
		if err != nil {
			t.Fatal(err)
		}
		var seen []string
		for rows.Next() {
			var seq int64
			var id string
			if err := rows.Scan(&seq, &id); err != nil {
				t.Fatal(err)
			}
			hwm, seen = max(hwm, seq), append(seen, id)
		}
		return seen
	}
	lateID, laterID := harness.NewUUID(), harness.NewUUID()
	interleave := func(publishBetween func()) {
		late := e.DB.Connect(t)
		tx, err := late.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		insert := `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'Late', '{}')`
		if _, err := tx.Exec(ctx, insert, lateID, "agg-late"); err != nil {
			t.Fatal(err)
		}
		other := e.DB.Connect(t)
		if _, err := other.Exec(ctx, insert, laterID, "agg-other"); err != nil {
			t.Fatal(err)
		}
		publishBetween()
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}

	var hwmSaw []string
	interleave(func() { hwmSaw = append(hwmSaw, pollHWM()...) })
	hwmSaw = append(hwmSaw, pollHWM()...)
	if slices.Contains(hwmSaw, lateID) || !slices.Contains(hwmSaw, laterID) {
		t.Fatalf("the high-water-mark poller saw %v: the scenario must make it see %s and miss %s", hwmSaw, laterID, lateID)
	}

	// Poll mode, over a fresh pair in the same interleaving.
	e.DB.Exec(t, "TRUNCATE outbox_events, outbox_events_poll")
	lateID, laterID = harness.NewUUID(), harness.NewUUID()
	e.startPoller()
	interleave(func() {
		harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{laterID}, time.Minute)
	})
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{laterID, lateID}, time.Minute)
	if n := e.unpublished(); n != 0 {
		t.Errorf("%d rows still unpublished", n)
	}
}

// An event Kafka refuses for good (larger than its topic takes) goes to
// the quarantine table at once; other aggregates flow, the later events of
// its own aggregate wait for it, and `quarantine replay` delivers it, after
// which they follow in order.
func TestPollPoisonIsQuarantinedAggregateWaitsReplayDelivers(t *testing.T) {
	e := newEnv(t)
	e.Kafka.CreateTopic(t, "outbox.event.order", partitions, map[string]string{"max.message.bytes": "4000"})
	poller := e.startPoller()
	conn := e.DB.Connect(t)
	ctx := context.Background()
	commit := func(ev harness.OutboxEvent) string {
		t.Helper()
		if err := e.Commit(ctx, conn, []harness.OutboxEvent{ev}); err != nil {
			t.Fatal(err)
		}
		ids, _ := e.Committed()
		return ids[len(ids)-1]
	}
	small := func(agg string, n int) harness.OutboxEvent {
		return harness.OutboxEvent{AggregateType: "order", AggregateID: agg, EventType: "Small", Payload: fmt.Sprintf(`{"n": %d}`, n)}
	}
	before := commit(small("poisoned", 1))
	poison := commit(harness.OutboxEvent{AggregateType: "order", AggregateID: "poisoned", EventType: "Huge",
		Payload: fmt.Sprintf(`{"blob": %q}`, strings.Repeat("x", 10000))})
	after := commit(small("poisoned", 3))
	other := commit(small("healthy", 4))

	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{before, other}, time.Minute)
	harness.WaitFor(t, 30*time.Second, "the poison event is quarantined", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE event_id = $1 AND error_class = 'permanent'", poison) == 1
	})
	// One attempt reached Kafka: the restart that taught the producer the
	// topic's smaller limit sent nothing, and is not an attempt.
	e.checkQuarantineAttempts(poller, poison, 1)
	// The aggregate waits: its later event stays unpublished while the
	// poison one is quarantined, across several claims.
	waitClaims(t, poller, 3)
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE event_id = $1 AND published_at IS NULL AND attempts = 0", after); n != 1 {
		t.Fatalf("the event after the quarantined one was claimed or published (%d rows pending and never tried): it must wait for the replay", n)
	}

	adm := kadm.NewClient(e.Kafka.Client(t))
	limit := "1048588"
	if _, err := adm.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Op: kadm.SetConfig, Name: "max.message.bytes", Value: &limit}}, "outbox.event.order"); err != nil {
		t.Fatal(err)
	}
	replay := harness.StartProcess(t, e.Bin, []string{"quarantine", "replay", "--all", "--pg-dsn", e.DB.DSN(), "--kafka-brokers", e.Kafka.BrokerList()}, nil)
	if code, err := replay.Wait(2 * time.Minute); err != nil || code != 0 {
		t.Fatalf("quarantine replay exited %d (%v): %s", code, err, replay.Output())
	}
	records := e.ConsumeAll(time.Minute)
	if len(records) != 4 {
		t.Errorf("%d records for 4 events", len(records))
	}
}

// A retriable failure backs off per event, with the attempts counted in
// the state table; after --max-attempts the event is quarantined with its
// class and stays replayable.
func TestPollRetriableFailuresBackOffThenQuarantine(t *testing.T) {
	e := newEnv(t)
	fault := e.Kafka.FailProduceTo("outbox.event.flaky", -1, kerr.NotEnoughReplicas.Code)
	poller := e.startPoller("--max-attempts", "3")
	conn := e.DB.Connect(t)
	if err := e.Commit(context.Background(), conn, []harness.OutboxEvent{{AggregateType: "flaky", AggregateID: "f-1", EventType: "Tried", Payload: `{}`}}); err != nil {
		t.Fatal(err)
	}
	ids, _ := e.Committed()
	harness.WaitFor(t, time.Minute, "the event is quarantined after its attempts", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE event_id = $1 AND error_class = 'retriable'", ids[0]) == 1
	})
	var attempts int64
	var lastClass string
	row := conn.QueryRow(context.Background(), "SELECT attempts, last_error_class FROM outbox_events_poll WHERE event_id = $1", ids[0])
	if err := row.Scan(&attempts, &lastClass); err != nil {
		t.Fatal(err)
	}
	if attempts != 3 || lastClass != "retriable" {
		t.Errorf("state says %d attempts, last error class %q; want 3 and retriable", attempts, lastClass)
	}
	e.checkQuarantineAttempts(poller, ids[0], 3)
	if errs := harness.Metric(t, poller.AdminURL(t), "outbox_relay_publish_errors_total", "class", "retriable"); errs != 3 {
		t.Errorf("outbox_relay_publish_errors_total{class=retriable} = %v, want 3 (one per attempt)", errs)
	}
	// Backoff: the three attempts waited at least the upper halves of the
	// first two backoffs (--poll-backoff-min 100ms, then 200ms).
	took := e.DB.QueryInt64(t, `SELECT (extract(epoch FROM q.first_failed_at - o.created_at) * 1000)::bigint
		FROM outbox_quarantine q JOIN outbox_events o USING (event_id) WHERE event_id = $1`, ids[0])
	if took < 150 {
		t.Errorf("three attempts took %d ms from the insert to the quarantine: they did not back off", took)
	}
	fault.Remove()
	replay := harness.StartProcess(t, e.Bin, []string{"quarantine", "replay", "--all", "--pg-dsn", e.DB.DSN(), "--kafka-brokers", e.Kafka.BrokerList()}, nil)
	if code, err := replay.Wait(2 * time.Minute); err != nil || code != 0 {
		t.Fatalf("quarantine replay exited %d (%v): %s", code, err, replay.Output())
	}
	e.ConsumeAll(time.Minute)
	harness.WaitFor(t, 30*time.Second, "the replayed event's row is settled as published", func() bool { return e.unpublished() == 0 })
}

// Retention deletes published rows older than --retention, in batches,
// and never a pending or quarantined row however old; the dry run only
// counts.
func TestPollRetentionNeverDeletesPendingOrQuarantined(t *testing.T) {
	e := newEnv(t)
	conn := e.DB.Connect(t)
	e.writeEvents(conn, 10, 3, 4)
	poller := e.startPoller()
	e.ConsumeAll(time.Minute)
	poller.Stop(30 * time.Second)

	// Three more rows, never published: one pending, one backing off,
	// one quarantined. All rows look a day old.
	e.writeEvents(conn, 1, 3, 4)
	e.DB.Exec(t, `UPDATE outbox_events_poll SET next_attempt_at = now() + interval '1 hour', attempts = 2
		WHERE seq = (SELECT max(seq) - 1 FROM outbox_events_poll)`)
	e.DB.Exec(t, `UPDATE outbox_events_poll SET quarantined_at = now() WHERE seq = (SELECT max(seq) FROM outbox_events_poll)`)
	e.DB.Exec(t, `UPDATE outbox_events_poll SET inserted_at = inserted_at - interval '1 day',
		published_at = CASE WHEN published_at IS NOT NULL THEN now() - interval '1 day' END`)
	e.DB.Exec(t, `UPDATE outbox_events SET created_at = created_at - interval '1 day'`)
	// Keep the pending one from being published while retention runs: a
	// poller started now would publish it, so hold it back with a lease
	// of a poller that is not running.
	e.DB.Exec(t, `UPDATE outbox_events_poll SET lease_holder = 'elsewhere', lease_expires_at = now() + interval '1 hour'
		WHERE seq = (SELECT max(seq) - 2 FROM outbox_events_poll)`)

	dry := e.startPoller("--retention", "1h", "--retention-dry-run", "--retention-batch", "7")
	dry.WaitForOutput(t, `"rows":30,`, time.Minute)
	dry.WaitForOutput(t, "retention dry run", time.Minute)
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events"); n != 33 {
		t.Fatalf("the dry run left %d rows, want all 33", n)
	}
	dry.Stop(30 * time.Second)

	wet := e.startPoller("--retention", "1h", "--retention-batch", "7")
	harness.WaitFor(t, time.Minute, "retention deletes the published rows", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events") == 3
	})
	if n := harness.Metric(t, wet.AdminURL(t), "outbox_relay_retention_rows_deleted_total"); n != 30 {
		t.Errorf("outbox_relay_retention_rows_deleted_total = %v, want 30", n)
	}
	if n := e.DB.QueryInt64(t, `SELECT count(*) FROM outbox_events o JOIN outbox_events_poll s USING (event_id) WHERE s.published_at IS NULL`); n != 3 {
		t.Errorf("%d of the 3 unpublished rows (pending, backing off, quarantined) are left with their state", n)
	}
}

// Issue 40.11: poll mode's --retention counted from the publish time while
// --column-created-at's help said retention selects by that column, and
// --retention-margin did nothing there. One rule in every table source:
// a row goes once it is published and was inserted longer ago than
// --retention. A row published just now but inserted two hours ago goes
// under --retention 1h; one inserted just now, published as long ago as
// you like, stays. The margin, which only the WAL source needs, is refused.
func TestPollRetentionSelectsByInsertTime(t *testing.T) {
	e := newEnv(t)
	conn := e.DB.Connect(t)
	e.writeEvents(conn, 4, 5, 4)
	poller := e.startPoller()
	e.ConsumeAll(time.Minute)
	poller.Stop(30 * time.Second)
	e.DB.Exec(t, `UPDATE outbox_events SET created_at = now() - interval '2 hours'
		WHERE event_id IN (SELECT event_id FROM outbox_events ORDER BY event_id LIMIT 12)`)
	e.DB.Exec(t, `UPDATE outbox_events_poll SET published_at = now() - interval '1 day'
		WHERE event_id IN (SELECT event_id FROM outbox_events ORDER BY event_id DESC LIMIT 8)`)

	code, out := harness.RunCommand(t, e.Bin, []string{"run", "--source", "poll", "--pg-dsn", e.DB.DSN(), "--kafka-brokers", e.Kafka.BrokerList(),
		"--admin-addr", "", "--retention", "1h", "--retention-margin", "5m"})
	if code != 2 || !strings.Contains(out, "--retention-margin 5m0s with --source poll") {
		t.Errorf("--retention-margin in poll mode: exit %d, want 2 naming it:\n%s", code, out)
	}

	wet := e.startPoller("--retention", "1h")
	harness.WaitFor(t, time.Minute, "retention deletes the rows inserted two hours ago", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events") == 8
	})
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events WHERE created_at < now() - interval '1 hour'"); n != 0 {
		t.Errorf("%d rows inserted before the retention remain", n)
	}
	if n := harness.Metric(t, wet.AdminURL(t), "outbox_relay_retention_rows_deleted_total"); n != 12 {
		t.Errorf("outbox_relay_retention_rows_deleted_total = %v, want 12", n)
	}
}

// Poll mode refuses exactly-once and an unknown source before touching
// anything: exit 2, naming the flag.
func TestPollRefusesWhatItCannotDo(t *testing.T) {
	bin := harness.BuildRelay(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "--source", "poll", "--delivery", "exactly-once", "--pg-dsn", "host=127.0.0.1", "--kafka-brokers", "127.0.0.1:9"}, "--delivery exactly-once needs --source wal or messages"},
		{[]string{"run", "--source", "polling", "--pg-dsn", "host=127.0.0.1", "--kafka-brokers", "127.0.0.1:9"}, `--source "polling": use wal, poll or messages`},
		{[]string{"run", "--source", "poll", "--poll-lease", "1m", "--kafka-timeout", "30s", "--pg-dsn", "host=127.0.0.1", "--kafka-brokers", "127.0.0.1:9"}, "--poll-lease 1m0s: must be at least 2m10s"},
		{[]string{"migrate", "--source", "poll", "--poll-existing", "maybe", "--pg-dsn", "host=127.0.0.1"}, `--poll-existing "maybe"`},
	} {
		code, out := harness.RunCommand(t, bin, c.args)
		if code != 2 || !strings.Contains(out, c.want) {
			t.Errorf("%v: exit %d, output %q; want exit 2 saying %q", c.args, code, out, c.want)
		}
	}
}

// /poll and `status --source poll` say what poll mode has: pending rows,
// their age, leases, quarantined rows; /slot says there is no slot.
func TestPollStatusAndAdminEndpoint(t *testing.T) {
	e := newEnv(t)
	conn := e.DB.Connect(t)
	e.writeEvents(conn, 3, 2, 2)
	e.DB.Exec(t, `UPDATE outbox_events_poll SET quarantined_at = now() WHERE seq = (SELECT min(seq) FROM outbox_events_poll)`)
	poller := e.startPoller("--poll-worker-id", "poller-a")
	harness.WaitFor(t, time.Minute, "the other aggregate is published", func() bool { return e.unpublished() == 3 })

	code, out := harness.RunCommand(t, e.Bin, []string{"status", "--source", "poll", "--pg-dsn", e.DB.DSN()})
	var status struct {
		Source      string   `json:"source"`
		Pending     int64    `json:"pending"`
		Quarantined int64    `json:"quarantined"`
		Age         *float64 `json:"oldest_pending_age_seconds"`
	}
	if code != 0 || json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &status) != nil {
		t.Fatalf("status exited %d:\n%s", code, out)
	}
	if status.Source != "poll" || status.Pending != 3 || status.Quarantined != 1 || status.Age == nil {
		t.Errorf("status says %+v; want poll, 3 pending (the quarantined row and the two behind it), 1 quarantined, an age", status)
	}
	harness.WaitFor(t, time.Minute, "/poll shows the table's state", func() bool {
		_, body := harness.HTTPGet(t, poller.AdminURL(t)+"/poll")
		return strings.Contains(body, `"state": "polling"`) && strings.Contains(body, `"worker_id": "poller-a"`) && strings.Contains(body, `"pending": 3`)
	})
	if pending := harness.Metric(t, poller.AdminURL(t), "outbox_relay_poll_pending_rows"); pending != 3 {
		t.Errorf("outbox_relay_poll_pending_rows = %v, want 3", pending)
	}
	if code, body := harness.HTTPGet(t, poller.AdminURL(t)+"/slot"); code != 404 || !strings.Contains(body, "/poll") {
		t.Errorf("/slot answered %d %q in poll mode", code, body)
	}
}

// migrate --source poll tracks the rows already in the outbox: as pending
// by default (published again, never lost), or as published with
// --poll-existing published; migrate says how many either way.
func TestPollMigrateTracksExistingRows(t *testing.T) {
	for _, existing := range []string{"pending", "published"} {
		t.Run(existing, func(t *testing.T) {
			db := cluster.CreateTestDatabase(t)
			e := &env{harness.NewEnv(t, db, "", partitions)}
			bin := e.Bin
			e.Migrate("--skip-slot") // the WAL path's schema first
			e.writeEvents(db.Connect(t), 4, 3, 5)
			code, out := harness.RunCommand(t, bin, []string{"migrate", "--source", "poll", "--poll-existing", existing, "--pg-dsn", db.DSN()})
			if code != 0 || !strings.Contains(out, "poll state of 12 rows already in the outbox, marked "+existing) {
				t.Fatalf("migrate exited %d, want 0 saying it tracked 12 rows as %s:\n%s", code, existing, out)
			}
			if n := e.unpublished(); existing == "published" && n != 0 || existing == "pending" && n != 12 {
				t.Fatalf("%d rows unpublished after migrate --poll-existing %s", n, existing)
			}
			e.startPoller()
			if existing == "pending" {
				e.ConsumeAll(time.Minute)
				return
			}
			// Published ones stay untouched: a new event goes out alone.
			before := e.CommittedCount()
			e.writeEvents(db.Connect(t), 1, 1, 5)
			ids, _ := e.Committed()
			records := harness.ConsumeEventIDs(t, e.Brokers, `^outbox\.event\.`, ids[before:], time.Minute)
			if len(records) != 1 {
				t.Errorf("%d records after one new event; the rows marked published were sent again", len(records))
			}
		})
	}
}

// A table migrated for poll mode still serves the WAL path: the trigger
// and the state table change nothing it reads, and the publication still
// carries the inserts.
func TestWALPathWorksOnATableMigratedForPolling(t *testing.T) {
	e := newEnv(t) // migrate --source poll
	slot := "wal_on_poll_table"
	harness.Migrate(t, e.Bin, []string{"migrate", "--pg-dsn", e.DB.DSN(), "--slot", slot})
	e.DB.DropSlotAtEnd(t, slot)
	harness.StartStreaming(t, e.Bin, harness.RelayFlags{DSN: e.DB.DSN(), Slot: slot, Brokers: e.Kafka.Brokers()}.Args("run"))
	e.writeEvents(e.DB.Connect(t), 10, 2, 3)
	records := e.ConsumeAll(time.Minute)
	if len(records) != e.CommittedCount() {
		t.Errorf("%d records for %d events", len(records), e.CommittedCount())
	}
	if n := e.unpublished(); n != int64(e.CommittedCount()) {
		t.Errorf("%d rows pending in the state table, want all %d: no poller ran, and the WAL path does not mark them", n, e.CommittedCount())
	}
}

// A poller holds no lock and no transaction while it waits for Kafka: its
// claim commits before it publishes. With every produce request held, the
// claimed rows can be locked by another session at once, and the poller's
// sessions are idle, not idle in transaction.
func TestPollHoldsNoLockWhilePublishing(t *testing.T) {
	e := newEnv(t)
	release := e.Kafka.HoldProduce()
	defer release()
	e.startPoller("--pg-dsn", e.DB.DSN()+"&application_name=poller-under-test")
	e.writeEvents(e.DB.Connect(t), 3, 1, 3)
	harness.WaitFor(t, time.Minute, "the rows are claimed and their records held by the broker", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE lease_holder IS NOT NULL") == 3 && e.Kafka.HeldProduces() > 0
	})
	conn := e.DB.Connect(t)
	tx, err := conn.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	var locked int
	err = tx.QueryRow(context.Background(), `SELECT count(*) FROM (SELECT seq FROM outbox_events_poll WHERE lease_holder IS NOT NULL FOR UPDATE NOWAIT) x`).Scan(&locked)
	if err != nil || locked != 3 {
		t.Fatalf("locking the claimed rows while their records wait for Kafka: %d rows, %v; the poller must hold no lock then", locked, err)
	}
	if n := e.DB.QueryInt64(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'poller-under-test' AND state <> 'idle'`); n != 0 {
		t.Errorf("%d of the poller's sessions are not idle while it waits for Kafka", n)
	}
	tx.Rollback(context.Background())
	release()
	e.ConsumeAll(time.Minute)
}

// The index of unpublished rows stays the size of the backlog, not of the
// table: after rounds of events published and vacuumed, its pages are
// reused, while the table keeps every row. Without reuse it would end six
// times its size after the first round; measured here: 1.6 times.
func TestPollPendingIndexStaysSmall(t *testing.T) {
	e := newEnv(t)
	e.startPoller()
	conn := e.DB.Connect(t)
	round := func() int64 {
		t.Helper()
		e.writeEvents(conn, 20, 100, 50)
		harness.WaitFor(t, time.Minute, "the round published", func() bool { return e.unpublished() == 0 })
		// Twice: a page emptied by one vacuum is reusable after the next.
		e.DB.Exec(t, "VACUUM outbox_events_poll")
		e.DB.Exec(t, "VACUUM outbox_events_poll")
		return e.DB.QueryInt64(t, "SELECT pg_relation_size('outbox_events_poll_pending_idx')")
	}
	first := round()
	var last int64
	for range 5 {
		last = round()
	}
	table := e.DB.QueryInt64(t, "SELECT pg_relation_size('outbox_events_poll')")
	t.Logf("pending index after 2,000 events: %d bytes; after 12,000: %d bytes; the state table: %d bytes", first, last, table)
	if last > 3*first {
		t.Errorf("the pending index grew from %d to %d bytes over 6 rounds of 2,000 events with none pending at the end: it grows with the table, not the backlog", first, last)
	}
}

// A WAL relay and a poller on one table would each publish every event,
// twice in all with no warning. Whichever starts second refuses (exit 1),
// naming what runs and what to do; once the other stopped, it starts.
func TestPollAndWALRelayRefuseToRunTogether(t *testing.T) {
	e := newEnv(t) // migrate --source poll
	slot := "wal_beside_poll"
	harness.Migrate(t, e.Bin, []string{"migrate", "--pg-dsn", e.DB.DSN(), "--slot", slot})
	e.DB.DropSlotAtEnd(t, slot)
	walArgs := harness.RelayFlags{DSN: e.DB.DSN(), Slot: slot, Brokers: e.Kafka.Brokers()}.Args("run")
	refused := func(p *harness.Process, what string, says ...string) {
		t.Helper()
		code, err := p.Wait(time.Minute)
		if err != nil || code != 1 {
			t.Fatalf("%s beside the other mode: exit %d (%v), want 1:\n%s", what, code, err, harness.LastLines(p.Output(), 20))
		}
		for _, s := range says {
			if !strings.Contains(p.Output(), s) {
				t.Fatalf("%s refused without saying %q:\n%s", what, s, harness.LastLines(p.Output(), 20))
			}
		}
	}

	wal := harness.StartStreaming(t, e.Bin, walArgs)
	for _, flags := range [][]string{
		{"--slot", slot},
		// The default --slot is not the WAL relay's: its walsender's
		// command names the table's publication.
		nil,
	} {
		refused(harness.StartProcess(t, e.Bin, e.pollArgs(flags...), nil), "a poller",
			slot, "is active", "a WAL relay (run --source wal) is streaming", "stop that relay first", "Switching between the two")
	}
	if _, err := wal.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 30*time.Second, "the stopped relay's walsender lets the slot go", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND active", slot) == 0
	})

	poller := e.startPoller("--slot", slot)
	refused(harness.StartProcess(t, e.Bin, walArgs, nil), "a WAL relay",
		"1 poll-mode relays (run --source poll) are polling", "stop them first", "Switching between the two")
	// Only the poller published: each event once.
	e.writeEvents(e.DB.Connect(t), 5, 2, 3)
	if records := e.ConsumeAll(time.Minute); len(records) != e.CommittedCount() {
		t.Errorf("%d records for %d events with one relay running", len(records), e.CommittedCount())
	}
	if _, err := poller.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	// The poller's lock left with its session: the WAL relay starts.
	harness.StartStreaming(t, e.Bin, walArgs)
}

// run --source poll --reconcile-every runs the periodic comparison, as on
// the WAL path: rows marked published that Kafka never got are reported
// missing, and never republished.
func TestPollPeriodicReconcileReportsMissingEvents(t *testing.T) {
	e := newEnv(t)
	conn := e.DB.Connect(t)
	e.writeEvents(conn, 3, 1, 3)
	lost, _ := e.Committed()
	// Marked published by hand, as a relay that lost them would leave
	// them: no poller sends them.
	e.DB.Exec(t, "UPDATE outbox_events_poll SET published_at = now()")
	e.Forget(lost)
	p := e.startPoller("--admin-addr", "127.0.0.1:0", "--reconcile-every", "200ms", "--reconcile-window", "1h", "--reconcile-settle", "0s")
	admin := p.AdminURL(t)
	metric := func(name string) (float64, bool) { return harness.MetricValue(harness.Scrape(t, admin), name) }
	if v, ok := metric("outbox_relay_reconcile_interval_seconds"); !ok || v != 0.2 {
		t.Fatalf("outbox_relay_reconcile_interval_seconds = %v (present %v), want 0.2", v, ok)
	}
	e.writeEvents(conn, 2, 1, 3)
	e.ConsumeAll(time.Minute)
	harness.WaitFor(t, time.Minute, "a check reports the 3 lost events", func() bool {
		missing, ok := metric("outbox_relay_reconcile_missing_events")
		last, _ := metric("outbox_relay_reconcile_last_complete_timestamp_seconds")
		return ok && missing == 3 && last > 0
	})
}

// A state table made before leases named their session lacks two columns:
// the poller refuses (exit 1) naming the command that adds them, and
// `migrate --source poll` on the existing install adds them.
func TestPollMigrateAddsLeaseSessionColumns(t *testing.T) {
	e := newEnv(t)
	e.DB.Exec(t, "ALTER TABLE outbox_events_poll DROP COLUMN lease_pid, DROP COLUMN lease_backend_start")
	old := harness.StartProcess(t, e.Bin, e.pollArgs(), nil)
	if code, err := old.Wait(time.Minute); err != nil || code != 1 ||
		!strings.Contains(old.Output(), "predates this release") || !strings.Contains(old.Output(), "migrate --source poll") {
		t.Fatalf("a poller on the old state table: exit %d (%v), want 1 naming migrate:\n%s", code, err, harness.LastLines(old.Output(), 20))
	}
	code, out := harness.RunCommand(t, e.Bin, []string{"migrate", "--source", "poll", "--pg-dsn", e.DB.DSN()})
	if code != 0 || !strings.Contains(out, "lease_pid, lease_backend_start") {
		t.Fatalf("migrate on the old state table: exit %d, want 0 naming the columns it added:\n%s", code, out)
	}
	if code, out := harness.RunCommand(t, e.Bin, []string{"migrate", "--source", "poll", "--pg-dsn", e.DB.DSN()}); code != 0 || !strings.Contains(out, "schema is up to date") {
		t.Fatalf("migrate again: exit %d, want 0 and nothing to do:\n%s", code, out)
	}
	e.startPoller()
	e.writeEvents(e.DB.Connect(t), 3, 2, 3)
	e.ConsumeAll(time.Minute)
}

// A poison event a poller claimed before it died has had one attempt
// already: the next poller's claim is its second, and its log line and
// `quarantine list` both say 2.
func TestPollQuarantineCountsEarlierClaims(t *testing.T) {
	e := newEnv(t)
	e.Kafka.CreateTopic(t, "outbox.event.order", partitions, map[string]string{"max.message.bytes": "4000"})
	if err := e.Commit(context.Background(), e.DB.Connect(t), []harness.OutboxEvent{{AggregateType: "order", AggregateID: "o-1", EventType: "Huge",
		Payload: fmt.Sprintf(`{"blob": %q}`, strings.Repeat("x", 10000))}}); err != nil {
		t.Fatal(err)
	}
	ids, _ := e.Committed()
	// What a poller that claimed it and died leaves: one attempt, a lease
	// that has ended.
	e.DB.Exec(t, "UPDATE outbox_events_poll SET attempts = 1, lease_holder = 'gone:1', lease_expires_at = now() - interval '1 second'")
	p := e.startPoller()
	harness.WaitFor(t, 30*time.Second, "the poison event is quarantined", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE event_id = $1", ids[0]) == 1
	})
	e.checkQuarantineAttempts(p, ids[0], 2)
}

// With --poll-session-check=false (behind a transaction-mode pooler) a
// lease names no session and the poller holds no lock: a killed poller's
// rows wait for --poll-lease, as its server session might be shared, and
// are then published by another poller.
func TestPollWithoutSessionCheckLeasesLastTheirTime(t *testing.T) {
	e := newEnv(t)
	release := e.Kafka.HoldProduce()
	defer release()
	first := e.startPoller("--poll-session-check=false")
	e.writeEvents(e.DB.Connect(t), 3, 1, 3)
	harness.WaitFor(t, time.Minute, "the rows are claimed and their records held by the broker", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE lease_holder IS NOT NULL") == 3 && e.Kafka.HeldProduces() > 0
	})
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE lease_pid IS NOT NULL OR lease_backend_start IS NOT NULL"); n != 0 {
		t.Errorf("%d leases name a session with --poll-session-check=false", n)
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 1886350444"); n != 0 {
		t.Errorf("%d poller locks held with --poll-session-check=false", n)
	}
	expires := e.DB.QueryString(t, "SELECT max(lease_expires_at)::text FROM outbox_events_poll")
	first.Kill()
	release()
	e.startPoller("--poll-session-check=false")
	e.ConsumeAll(time.Minute)
	harness.WaitFor(t, time.Minute, "every row marked published", func() bool { return e.unpublished() == 0 })
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE published_at < $1::timestamptz", expires); n != 0 {
		t.Errorf("%d rows of the killed poller were published before its lease expired at %s", n, expires)
	}
}

// Issue 30: poll mode on an outbox table partitioned by created_at. The
// statement-level trigger with a transition table sits on the partitioned
// table (PostgreSQL 13 and later fire it for rows routed to any
// partition), so events inserted into both partitions are tracked and
// published.
func TestPollPartitionedOutbox(t *testing.T) {
	db := cluster.CreateTestDatabase(t)
	db.Exec(t, harness.PartitionedOutboxSQL)
	e := newEnvOn(t, db)
	e.startPoller()
	ids := harness.InsertIntoPartitions(t, db, "order")
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.order$`, ids, time.Minute)
	harness.WaitFor(t, 30*time.Second, "both events marked published", func() bool { return e.unpublished() == 0 })
}

// While a backlog drains, the poller claims the next batch as soon as one
// is handed to Kafka, instead of waiting for its acks and marks: here the
// broker holds the first batch's records, and the second batch is claimed
// meanwhile. The second claim leaves out the rows behind the first
// batch's, so no aggregate has two rows leased at once, and first
// delivery stays in order.
func TestPollClaimsTheNextBatchWhileOnePublishes(t *testing.T) {
	e := newEnv(t)
	e.writeEvents(e.DB.Connect(t), 8, 1, 4) // aggregates 0, 1, 2, 3, 0, 1, 2, 3
	release := e.Kafka.HoldProduce()
	defer release()
	e.startPoller("--poll-batch", "2")
	harness.WaitFor(t, time.Minute, "two batches leased while Kafka holds the first", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE lease_holder IS NOT NULL") == 4 && e.Kafka.HeldProduces() > 0
	})
	if n := e.DB.QueryInt64(t, `SELECT count(*) FROM (SELECT aggregate_id FROM outbox_events_poll WHERE lease_holder IS NOT NULL
		GROUP BY aggregate_type, aggregate_id HAVING count(*) > 1) x`); n != 0 {
		t.Errorf("%d aggregates have two rows leased at once: the second claim must leave out the rows behind the first batch's", n)
	}
	if n := e.DB.QueryInt64(t, "SELECT max(seq) FROM outbox_events_poll WHERE lease_holder IS NOT NULL"); n != 4 {
		t.Errorf("the leased rows end at seq %d, want 4: the first four rows, one per aggregate", n)
	}
	release()
	e.ConsumeAll(time.Minute)
}

// Issue 41: the WAL path refused a row with an empty aggregate_id (the
// record's key) and quarantined it; poll mode, its own copy of the publish
// path, skipped the row checks and published it with an empty key, on
// whatever partition that hashes to. Both now run the same checks.
func TestPollRefusesTheRowsTheWALPathRefuses(t *testing.T) {
	e := newEnv(t)
	e.startPoller()
	conn := e.DB.Connect(t)
	ctx := context.Background()
	if err := e.Commit(ctx, conn, []harness.OutboxEvent{{AggregateType: "order", AggregateID: "", EventType: "Placed", Payload: `{"n": 1}`}}); err != nil {
		t.Fatal(err)
	}
	ids, _ := e.Committed()
	empty := ids[0]
	if err := e.Commit(ctx, conn, []harness.OutboxEvent{{AggregateType: "order", AggregateID: "o-2", EventType: "Placed", Payload: `{"n": 2}`}}); err != nil {
		t.Fatal(err)
	}
	ids, _ = e.Committed()
	healthy := ids[1]
	harness.WaitFor(t, time.Minute, "the row with an empty aggregate_id is quarantined", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE event_id = $1 AND error_class = 'permanent' AND error_message LIKE '%NULL or empty aggregate_id%'", empty) == 1
	})
	for _, r := range harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{healthy}, time.Minute) {
		if r.EventID() == empty {
			t.Fatalf("the row with an empty aggregate_id was published: %s/%d key %q", r.Topic, r.Partition, r.Key)
		}
	}
}

// Writers that use two-phase commit: PostgreSQL refuses PREPARE
// TRANSACTION in a transaction that sent a NOTIFY, and the lease
// strategy's trigger notified on every insert, so such a writer could not
// commit any business change with its event (the first PREPARE below shows
// it). `migrate --poll-notify=false` now makes the trigger record rows
// without the NOTIFY, on a table migrated before too; the poller looks
// every --poll-interval, publishes a prepared transaction's event once
// COMMIT PREPARED makes it visible, and never one rolled back.
func TestLeasePreparedTransactionsWithoutNotify(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	insert := `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'E', '{}')`
	tx, err := e.DB.Connect(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, insert, harness.NewUUID(), "agg-notified"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "PREPARE TRANSACTION 'outbox_relay_lease_notified'"); err == nil || !strings.Contains(err.Error(), "NOTIFY") {
		t.Fatalf("PREPARE TRANSACTION after an insert into an outbox whose trigger notifies: %v, want PostgreSQL's refusal naming NOTIFY", err)
	}

	e.Migrate("--poll-notify=false")
	e.startPoller("--poll-notify=false", "--poll-interval", "100ms")
	inPrepared, inAborted, beside, after := harness.NewUUID(), harness.NewUUID(), harness.NewUUID(), harness.NewUUID()
	conn := e.DB.Connect(t)
	for _, stmt := range []struct {
		sql  string
		args []any
	}{
		{"BEGIN", nil},
		{insert, []any{inPrepared, "agg-prepared"}},
		{"PREPARE TRANSACTION 'outbox_relay_lease_commit'", nil},
		{"BEGIN", nil},
		{insert, []any{inAborted, "agg-prepared"}},
		{"PREPARE TRANSACTION 'outbox_relay_lease_abort'", nil},
		{insert, []any{beside, "agg-beside"}},
	} {
		if _, err := conn.Exec(ctx, stmt.sql, stmt.args...); err != nil {
			t.Fatalf("%s: %v", stmt.sql, err)
		}
	}
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{beside}, time.Minute)
	e.DB.Exec(t, "COMMIT PREPARED 'outbox_relay_lease_commit'")
	e.DB.Exec(t, "ROLLBACK PREPARED 'outbox_relay_lease_abort'")
	if _, err := conn.Exec(ctx, insert, after, "agg-after"); err != nil {
		t.Fatal(err)
	}
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{beside, inPrepared, after}, time.Minute)
	for _, r := range records {
		if r.EventID() == inAborted {
			t.Errorf("event %s of a rolled-back prepared transaction was published", inAborted)
		}
	}
	if len(records) != 3 {
		t.Errorf("%d records for 3 events", len(records))
	}
}
