package reconcile_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// window covers everything a test commits; --until 0s ends it now instead
// of a minute ago, since the tests wait for delivery themselves.
var window = []string{"--since", "10m", "--until", "0s"}

// Events committed while the slot was dropped never reach Kafka. reconcile
// finds exactly them, republishes them while `run` keeps streaming, and a
// second pass finds nothing.
func TestGapIsFoundAndRepublished(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	relay := e.StartRelay()
	before := e.commit(6, "order")
	e.consumeAll(before)
	e.stopRelay(relay)

	e.DB.Exec(t, "SELECT pg_drop_replication_slot($1)", e.Slot)
	gap := e.commit(7, "order")
	gap = append(gap, e.commit(3, "customer")...)
	e.Migrate("--existing-rows", "published") // recreates the slot, as told: the gap is behind it
	relay = e.StartRelay()
	after := e.commit(5, "order")
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, append(before, after...), time.Minute)
	for _, r := range records {
		for _, id := range gap {
			if r.EventID() == id {
				t.Fatalf("gap event %s reached Kafka without reconcile: the test does not make a gap", id)
			}
		}
	}

	code, rep := e.reconcile(window...)
	if code != 3 {
		t.Fatalf("reconcile exited %d, want 3 (events missing)", code)
	}
	if !sameSet(rep.Missing, gap) {
		t.Fatalf("reconcile lists missing %v, want exactly the gap %v", rep.Missing, gap)
	}
	if rep.RowsChecked != 21 || rep.Found != 11 {
		t.Fatalf("rows checked %d, found %d; want 21 and 11", rep.RowsChecked, rep.Found)
	}

	code, rep = e.reconcile(append(window, "--republish")...)
	if code != 0 || rep.Republished != int64(len(gap)) {
		t.Fatalf("reconcile --republish exited %d having republished %d; want 0 and %d", code, rep.Republished, len(gap))
	}
	ids, _ := e.Committed()
	records = e.consumeAll(ids)
	for _, r := range records {
		if r.EventID() == gap[0] && (r.Headers["tenant"] != "acme" || string(r.Key) != "order-0" ||
			r.Headers["aggregate_type"] != "order" || r.Topic != "outbox.event.order" ||
			r.Partition != harness.JavaPartition(r.Key, partitions)) {
			t.Fatalf("republished record %s: topic %s partition %d key %q headers %v", r.EventID(), r.Topic, r.Partition, r.Key, r.Headers)
		}
	}

	code, rep = e.reconcile(window...)
	if code != 0 || len(rep.Missing) != 0 || rep.Found != 21 {
		t.Fatalf("second reconcile exited %d with %d missing, %d found; want 0, 0, 21", code, len(rep.Missing), rep.Found)
	}
	code, rep = e.reconcile(append(window, "--republish")...)
	if code != 0 || rep.Republished != 0 {
		t.Fatalf("republishing again exited %d and republished %d; want 0 and nothing", code, rep.Republished)
	}
	// run streamed through the republish beside it, and still stops cleanly.
	e.stopRelay(relay)
}

// A topic deleted by mistake and created again: every event of that topic
// in the window is reported and republished; the other topic is untouched.
func TestDeletedTopicIsRepublished(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	e.StartRelay()
	orders := e.commit(8, "order")
	customers := e.commit(4, "customer")
	e.consumeAll(append(orders, customers...))

	adm := kadm.NewClient(e.Kafka.Client(t))
	ctx := context.Background()
	if _, err := adm.DeleteTopic(ctx, "outbox.event.order"); err != nil {
		t.Fatalf("delete topic: %v", err)
	}
	harness.WaitFor(t, 30*time.Second, "the topic is gone", func() bool {
		topics, err := adm.ListTopics(ctx)
		return err == nil && !topics.Has("outbox.event.order")
	})
	e.Kafka.CreateTopic(t, "outbox.event.order", partitions, nil)

	code, rep := e.reconcile(window...)
	if code != 3 || !sameSet(rep.Missing, orders) {
		t.Fatalf("reconcile exited %d listing %v; want 3 and every order event %v", code, rep.Missing, orders)
	}
	code, rep = e.reconcile(append(window, "--republish")...)
	if code != 0 || rep.Republished != int64(len(orders)) {
		t.Fatalf("reconcile --republish exited %d, republished %d; want 0 and %d", code, rep.Republished, len(orders))
	}
	e.consumeAll(append(orders, customers...))
	if code, rep = e.reconcile(window...); code != 0 {
		t.Fatalf("reconcile after republish exited %d with missing %v", code, rep.Missing)
	}
}

// An event run quarantined is reported as quarantined, not missing.
func TestQuarantinedIsNotMissing(t *testing.T) {
	e := newEnv(t)
	e.Kafka.CreateTopic(t, "outbox.event.order", partitions, map[string]string{"max.message.bytes": "2000"})
	e.Migrate()
	e.StartRelay()
	small := e.commit(3, "order")
	big := make([]byte, 3000)
	rand.Read(big)
	if err := e.Commit(context.Background(), e.conn, []harness.OutboxEvent{{AggregateType: "order", AggregateID: "o-big",
		EventType: "Huge", Payload: fmt.Sprintf(`{"blob": %q}`, hex.EncodeToString(big))}}); err != nil {
		t.Fatal(err)
	}
	ids, _ := e.Committed()
	bigID := ids[len(ids)-1]
	small = append(small, e.commit(2, "order")...)
	e.consumeAll(small)
	harness.WaitFor(t, 30*time.Second, "run quarantines the oversize event", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine") == 1
	})

	code, rep := e.reconcile(window...)
	if code != 0 || len(rep.Missing) != 0 || !sameSet(rep.Quarantined, []string{bigID}) || rep.Found != int64(len(small)) {
		t.Fatalf("reconcile exited %d, missing %v, quarantined %v, found %d; want 0, none, [%s], %d",
			code, rep.Missing, rep.Quarantined, rep.Found, bigID, len(small))
	}
}

// Issue 24.6: replay deleted the quarantine row, so after an event was
// fixed in the quarantine table and replayed to another topic, reconcile
// reported it missing (exit 3) and --republish sent the original row again,
// which was quarantined again. Replay now keeps the row, marked with the
// topic it delivered to: reconcile finds the record there, and neither
// reports nor republishes the event.
func TestReplayedFixIsDelivered(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	e.StartRelay()
	before := e.commit(2, "order")
	bad := e.commit(1, "a b") // "outbox.event.a b": not a valid topic name
	after := e.commit(2, "order")
	e.consumeAll(append(before, after...))
	harness.WaitFor(t, 30*time.Second, "run quarantines the event with the invalid topic", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine") == 1
	})

	// The docs' fix: correct the row in the quarantine table, then replay.
	e.DB.Exec(t, "UPDATE outbox_quarantine SET aggregate_type = 'fixed_ab'")
	code, out := harness.RunCommand(t, e.Bin, append([]string{"quarantine"}, e.command("replay", "--all")...))
	if code != 0 || !strings.Contains(out, "to outbox.event.fixed_ab") {
		t.Fatalf("quarantine replay exited %d, want 0 and a delivery to outbox.event.fixed_ab:\n%s", code, out)
	}
	e.consumeAll(bad)

	code, rep := e.reconcile(window...)
	if code != 0 || len(rep.Missing) != 0 || len(rep.Quarantined) != 0 || rep.Found != 5 {
		t.Fatalf("reconcile exited %d, missing %v, quarantined %v, found %d; want 0, none, none, 5",
			code, rep.Missing, rep.Quarantined, rep.Found)
	}
	code, rep = e.reconcile(append([]string{"--republish"}, window...)...)
	if code != 0 || rep.Republished != 0 || len(rep.RepublishQuarantined) != 0 || len(rep.Missing) != 0 {
		t.Fatalf("reconcile --republish exited %d, republished %d, quarantined %v, missing %v; want 0 and nothing sent",
			code, rep.Republished, rep.RepublishQuarantined, rep.Missing)
	}
	if topic := e.DB.QueryString(t, "SELECT replayed_topic FROM outbox_quarantine WHERE replayed_at IS NOT NULL"); topic != "outbox.event.fixed_ab" {
		t.Fatalf("the quarantine table records the replay to %q, want outbox.event.fixed_ab", topic)
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE replayed_at IS NULL OR attempts > 1"); n != 0 {
		t.Fatalf("%d events quarantined again after reconcile --republish", n)
	}
	fixed := harness.ConsumeToEnd(t, e.Kafka.Brokers(), "outbox.event.fixed_ab", time.Minute)
	if len(fixed) != 1 || fixed[0].EventID() != bad[0] || string(fixed[0].Key) != "a b-0" {
		t.Fatalf("outbox.event.fixed_ab holds %d records (%v), want the fixed event %s once", len(fixed), fixed, bad[0])
	}
}

// Rows created before the window are ignored, though Kafka lacks them;
// widening the window reports exactly them, so the test can fail.
func TestRowsOutsideWindowAreIgnored(t *testing.T) {
	e := newEnv(t)
	e.Migrate("--skip-slot")
	old := e.commit(4, "order") // no slot yet: never published
	e.DB.Exec(t, "UPDATE outbox_events SET created_at = now() - interval '3 hours'")
	e.Migrate("--existing-rows", "published") // the rows before it stay unpublished
	e.StartRelay()
	recent := e.commit(5, "order")
	e.consumeAll(recent)

	if code, rep := e.reconcile(window...); code != 0 || rep.RowsChecked != 5 || len(rep.Missing) != 0 {
		t.Fatalf("reconcile of the last 10m exited %d, checked %d, missing %v; want 0, 5, none", code, rep.RowsChecked, rep.Missing)
	}
	code, rep := e.reconcile("--since", "4h", "--until", "0s")
	if code != 3 || !sameSet(rep.Missing, old) {
		t.Fatalf("reconcile of the last 4h exited %d, missing %v; want 3 and the old rows %v", code, rep.Missing, old)
	}
}

// Rows retention deleted after publishing are not reported: not as
// missing, and their records are not phantoms.
func TestRetentionDeletedRowsAreNotReported(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	relay := e.StartRelay("--retention", "1ms", "--retention-margin", "0s", "--retention-interval", "100ms")
	deleted := e.commit(6, "order")
	e.consumeAll(deleted)
	harness.WaitFor(t, 30*time.Second, "cleanup deletes the published rows", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events") == 0
	})
	e.stopRelay(relay)
	e.StartRelay()
	kept := e.commit(4, "order")
	e.consumeAll(append(deleted, kept...))

	code, rep := e.reconcile(window...)
	if code != 0 || rep.RowsChecked != 4 || len(rep.Missing) != 0 || len(rep.Phantoms) != 0 {
		t.Fatalf("reconcile exited %d, checked %d, missing %v, phantoms %v; want 0, 4, none, none",
			code, rep.RowsChecked, rep.Missing, rep.Phantoms)
	}
}

// A record in Kafka with no row (a phantom, as after a failover to a
// server that lost the row) is reported and left in place; a second record
// of an event is reported as delivered more than once.
func TestPhantomAndDuplicateAreReported(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	e.StartRelay()
	ids := e.commit(5, "order")
	e.consumeAll(ids)

	phantom := harness.NewUUID()
	cl := e.Kafka.Client(t)
	ctx := context.Background()
	for _, r := range []*kgo.Record{
		{Topic: "outbox.event.order", Key: []byte("order-1"), Value: []byte(`{}`),
			Headers: []kgo.RecordHeader{{Key: "event_id", Value: []byte(phantom)}}},
		{Topic: "outbox.event.order", Key: []byte("order-1"), Value: []byte(`{}`)},
		{Topic: "outbox.event.order", Key: []byte("order-0"), Value: []byte(`{}`),
			Headers: []kgo.RecordHeader{{Key: "event_id", Value: []byte(ids[0])}}},
	} {
		if err := cl.ProduceSync(ctx, r).FirstErr(); err != nil {
			t.Fatalf("produce: %v", err)
		}
	}

	code, rep := e.reconcile(append(window, "--margin", "0s")...)
	if code != 0 || len(rep.Phantoms) != 1 || rep.Phantoms[0].EventID != phantom || rep.UnidentifiedRecords != 1 {
		t.Fatalf("reconcile exited %d, phantoms %+v, unidentified %d; want 0, [%s], 1", code, rep.Phantoms, rep.UnidentifiedRecords, phantom)
	}
	if !sameSet(rep.Duplicated, ids[:1]) || rep.Found != int64(len(ids)) {
		t.Fatalf("delivered more than once %v, found %d; want [%s] and %d", rep.Duplicated, rep.Found, ids[0], len(ids))
	}
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, append(ids, phantom), time.Minute)
}

// Whatever creates the slot while the table holds rows, a relay or
// `migrate` (issue 51: only when told, with --existing-rows published),
// logs the reconcile command for them; run as logged, it finds
// exactly the rows the new slot will never deliver. `migrate` once said
// only "every event committed from now on will be published": run at a
// deploy after a failover, it made a slot over the lost one's gap without
// a word, and a relay with --on-slot-lost recover then found a slot and
// nothing to recover.
func TestNewSlotLogsReconcileCommand(t *testing.T) {
	for _, maker := range []string{"run", "migrate"} {
		t.Run(maker, func(t *testing.T) {
			e := newEnv(t)
			e.Migrate("--skip-slot")
			lost := e.commit(3, "order")
			var out string
			if maker == "migrate" {
				code, migrated := harness.RunCommand(t, e.Bin, e.command("migrate", "--slot-only", "--existing-rows", "published"))
				if code != 0 {
					t.Fatalf("migrate --slot-only exited %d:\n%s", code, migrated)
				}
				out = migrated
			}
			relay := e.StartRelay("--existing-rows", "published")
			published := e.commit(2, "order")
			e.consumeAll(published)
			if maker == "run" {
				out = relay.Output()
			}

			m := regexp.MustCompile(`"rows_in_table":3,.*"reconcile_command":"outbox-relay reconcile --since (\S+) --until (\S+) `).FindStringSubmatch(out)
			if m == nil {
				t.Fatalf("%s created the slot without naming the 3 rows and the reconcile command:\n%s", maker, out)
			}
			code, rep := e.reconcile("--since", m[1], "--until", m[2])
			if code != 3 || !sameSet(rep.Missing, lost) {
				t.Fatalf("the logged command exited %d listing %v; want 3 and exactly %v", code, rep.Missing, lost)
			}
		})
	}
}

// Issue 24.8: after ALTER TABLE ... DROP COLUMN headers, `reconcile
// --republish` failed with `column "headers" does not exist` while run
// and report-only reconcile worked; its query also named schema_version
// and occurred_at. The optional columns are now read only when the table
// has them, as run reads them by name.
func TestRepublishWithoutOptionalColumns(t *testing.T) {
	e := newEnv(t)
	e.Migrate("--skip-slot") // no slot: every row is missing from Kafka
	e.DB.Exec(t, "ALTER TABLE outbox_events DROP COLUMN headers, DROP COLUMN schema_version, DROP COLUMN occurred_at")
	ids := make([]string, 3)
	for i := range ids {
		ids[i] = harness.NewUUID()
		e.DB.Exec(t, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
			VALUES ($1, 'order', $2, 'Placed', $3::jsonb)`, ids[i], fmt.Sprintf("order-%d", i), fmt.Sprintf(`{"n": %d}`, i))
	}
	code, rep := e.reconcile("--since", "1h", "--until", "0s", "--republish")
	if code != 0 || rep.Republished != int64(len(ids)) {
		t.Fatalf("reconcile --republish exited %d with %d republished, want 0 and %d: %+v", code, rep.Republished, len(ids), rep)
	}
	records := e.consumeAll(ids)
	for _, r := range records {
		if _, ok := r.Headers["tenant"]; ok {
			t.Errorf("record %s carries a header the row did not have: %v", r.EventID(), r.Headers)
		}
	}
}

// Issue 42: a CI run of the promotion drill saw two events of one
// aggregate, written in one transaction, republished in reverse order.
// Republishing read a window by created_at, cmin and ctid; WAL replay sets
// cmin to 0 and ctid follows free space. One statement gives its rows one
// cmin on a primary too, so this reproduces it without a standby: page 0 is
// left with room for a small row only, page 1 with room for a large one,
// and one INSERT writes a large event then a small one of one aggregate.
// The small row lands on page 0, before the large one. Republishing now
// reads the table's insertion number.
func TestRepublishKeepsInsertOrderWithinAStatement(t *testing.T) {
	e := newEnv(t)
	e.Migrate("--skip-slot") // no slot: every row is missing from Kafka
	insert := func(aggregate, eventType string, pad int) string {
		return fmt.Sprintf(`(gen_random_uuid(), 'order', '%s', '%s', jsonb_build_object('pad', repeat('x', %d)))`, aggregate, eventType, pad)
	}
	fill := func(n int) {
		rows := make([]string, n)
		for i := range rows {
			rows[i] = insert(fmt.Sprintf("fill-%d", e.CommittedCount()+i), "Filled", fillerPad)
		}
		e.commitStatement(rows)
	}
	fill(fillersPerPage)                 // page 0, full but for a small row
	fill(fillersPerPage - 1)             // page 1, with room for one large row
	e.DB.Exec(t, "VACUUM outbox_events") // the free space map learns both
	written := e.commitStatement([]string{insert("order-x", "Large", largePad), insert("order-x", "Small", smallPad)})

	var largeFirst bool
	if err := e.conn.QueryRow(context.Background(), `SELECT (SELECT ctid FROM outbox_events WHERE event_id = $1)
		< (SELECT ctid FROM outbox_events WHERE event_id = $2)`, written[0], written[1]).Scan(&largeFirst); err != nil {
		t.Fatal(err)
	}
	if largeFirst {
		t.Fatal("the small row did not land before the large one: the test no longer builds the case it is for")
	}

	code, rep := e.reconcile("--since", "1h", "--until", "0s", "--republish")
	ids, order := e.Committed()
	if code != 0 || rep.Republished != int64(len(ids)) {
		t.Fatalf("reconcile --republish exited %d with %d republished, want 0 and %d: %+v", code, rep.Republished, len(ids), rep)
	}
	harness.CheckPerAggregateOrder(t, e.consumeAll(ids), order)
}

// The sizes that shape the pages in TestRepublishKeepsInsertOrderWithinAStatement.
const (
	fillersPerPage = 5
	fillerPad      = 1400
	largePad       = 1800
	smallPad       = 100
)

// commitStatement inserts rows (VALUES lists) in one statement and records
// their events in the order written.
func (e *env) commitStatement(values []string) []string {
	e.T.Helper()
	e.connect()
	rows, err := e.conn.Query(context.Background(), `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
		VALUES `+strings.Join(values, ", ")+` RETURNING event_id::text, aggregate_id, event_type`)
	if err != nil {
		e.T.Fatalf("insert: %v", err)
	}
	var ids []string
	var events []harness.OutboxEvent
	for rows.Next() {
		var id string
		var ev harness.OutboxEvent
		if err := rows.Scan(&id, &ev.AggregateID, &ev.EventType); err != nil {
			e.T.Fatalf("insert: %v", err)
		}
		ids, events = append(ids, id), append(events, ev)
	}
	if err := rows.Err(); err != nil {
		e.T.Fatalf("insert: %v", err)
	}
	e.Record(ids, events)
	return ids
}
