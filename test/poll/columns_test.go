package poll_test

import (
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// writerSetColumns are INSERTs that fill the relay's own columns, as an
// ORM that inserts every mapped column (NULL for the ones it does not
// know), or an INSERT ... SELECT * copy of an earlier row (that row's
// values), writes them. $1 is the new row's event id, $2 an earlier row's.
var writerSetColumns = map[string]string{
	"seq NULL": `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, outbox_relay_seq)
		VALUES ($1, 'order', 'orm-1', 'created', '{}', NULL)`,
	"xid NULL": `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, outbox_relay_xid)
		VALUES ($1, 'order', 'orm-2', 'created', '{}', NULL)`,
	"xid stale": `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, outbox_relay_xid, outbox_relay_seq)
		VALUES ($1, 'order', 'orm-3', 'created', '{}', '100', 1)`,
	"copy of a published row": `INSERT INTO outbox_events SELECT (SELECT $1::uuid), aggregate_type, 'orm-4', event_type, schema_version, payload,
		headers, occurred_at, created_at, outbox_relay_seq, outbox_relay_xid FROM outbox_events WHERE event_id = $2`,
}

// Issue 51, item 3: the snapshot strategy never published a row whose
// INSERT set outbox_relay_xid or outbox_relay_seq itself (NULL, or a
// stale value such as '100' or a copied row's): it was in no window,
// `status` said 0 pending, the gauges 0, nothing was logged, and
// retention deleted it as covered. Each is published now: a BEFORE
// INSERT trigger sets both columns on every row, whatever the INSERT
// said, and the poller refuses to start without it.
func TestSnapshotPublishesRowsWhoseInsertSetItsColumns(t *testing.T) {
	e := newSnapEnv(t)
	p := e.startSnapPoller()
	conn := e.DB.Connect(t)
	first := harness.NewUUID()
	e.DB.Exec(t, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'orm-0', 'created', '{}')`, first)
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), harness.RelayTopics, []string{first}, time.Minute)
	var want []string
	for name, insert := range writerSetColumns {
		id := harness.NewUUID()
		if _, err := conn.Exec(t.Context(), insert, insertArgs(insert, id, first)...); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		want = append(want, id)
	}
	// A hostile try: the stamp was the INSERT's only, and an ORM that
	// writes every column back in the same transaction hid the row again.
	// An UPDATE now keeps what the INSERT stamped.
	for name, update := range map[string]string{
		"update to NULL":           `UPDATE outbox_events SET outbox_relay_xid = NULL, outbox_relay_seq = NULL WHERE event_id = $1`,
		"update to an older stamp": `UPDATE outbox_events SET (outbox_relay_xid, outbox_relay_seq) = (SELECT outbox_relay_xid, outbox_relay_seq FROM outbox_events WHERE event_id = $2) WHERE event_id = $1`,
	} {
		id := harness.NewUUID()
		tx, err := conn.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(t.Context(), `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'orm-1', 'created', '{}')`, id); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		args := []any{id}
		if strings.Contains(update, "$2") {
			args = append(args, first)
		}
		if _, err := tx.Exec(t.Context(), update, args...); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := tx.Commit(t.Context()); err != nil {
			t.Fatal(err)
		}
		want = append(want, id)
	}
	for _, r := range harness.ConsumeEventIDs(t, e.Kafka.Brokers(), harness.RelayTopics, want, 30*time.Second) {
		t.Logf("published %s", r.EventID())
	}
	if n := e.DB.QueryInt64(t, `SELECT count(*) FROM outbox_events WHERE outbox_relay_xid IS NULL OR outbox_relay_seq IS NULL
		OR outbox_relay_xid = '100' OR outbox_relay_seq = 1 AND event_id <> $1`, first); n != 0 {
		t.Errorf("%d rows kept a value the writer gave the relay's columns", n)
	}

	// A trigger disabled under a running poller stops it within a gauge
	// reading (a hostile try found it went on, and the rows written
	// meanwhile were in no window), and without the trigger the poller
	// refuses to start; each says what to do.
	e.DB.Exec(t, "ALTER TABLE outbox_events DISABLE TRIGGER outbox_events_outbox_relay_stamp")
	if code, err := p.Wait(time.Minute); err != nil || code != 1 || !strings.Contains(p.Output(), "outbox_events_outbox_relay_stamp") {
		t.Fatalf("a poller whose stamp trigger was disabled under it: exit %d (%v), want 1 naming the trigger:\n%s", code, err, harness.LastLines(p.Output(), 5))
	}
	// Disabled, or firing only for replication (ENABLE REPLICA, which a
	// hostile try found accepted: every event lost).
	for _, off := range []string{"DISABLE TRIGGER", "ENABLE REPLICA TRIGGER"} {
		e.DB.Exec(t, "ALTER TABLE outbox_events "+off+" outbox_events_outbox_relay_stamp")
		code, out := harness.RunCommand(t, e.Bin, e.pollArgs(snapshotFlags...))
		if code == 0 || !strings.Contains(out, "outbox_events_outbox_relay_stamp") || !strings.Contains(out, "migrate --source poll --poll-strategy snapshot") {
			t.Errorf("poller with the stamp trigger after %s exited %d:\n%s\nwant a refusal that names the trigger and the migrate command", off, code, harness.LastLines(out, 5))
		}
	}
}

// Issue 51, item 3, the other sources' side: outbox_relay_seq orders
// republishing (reconcile, a lost slot's recovery) on the WAL path and
// the lease strategy's table alike, and an INSERT that set it to NULL or
// a copied row's number left it so. The same trigger numbers every row.
// The lease strategy itself reads no column a writer sets beyond the
// event's own: its state row is the trigger's, with a sequence number the
// writer cannot give.
func TestLeaseAndWALTableNumberRowsWhoseInsertSetTheColumn(t *testing.T) {
	e := newEnv(t)
	p := e.startPoller()
	first := harness.NewUUID()
	e.DB.Exec(t, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'orm-0', 'created', '{}')`, first)
	conn := e.DB.Connect(t)
	want := []string{first}
	for _, name := range []string{"seq NULL", "copy of a published row"} {
		insert := writerSetColumns[name]
		if name == "copy of a published row" {
			// The relay's table without the snapshot strategy's column.
			insert = strings.Replace(strings.Replace(insert, ", outbox_relay_xid FROM", " FROM", 1), "outbox_relay_seq, outbox_relay_xid", "outbox_relay_seq", 1)
		}
		id := harness.NewUUID()
		if _, err := conn.Exec(t.Context(), insert, insertArgs(insert, id, first)...); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		want = append(want, id)
	}
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), harness.RelayTopics, want, 30*time.Second)
	if n := e.DB.QueryInt64(t, `SELECT count(*) - count(DISTINCT outbox_relay_seq) + count(*) FILTER (WHERE outbox_relay_seq IS NULL) FROM outbox_events`); n != 0 {
		t.Errorf("%d rows unnumbered or numbered twice", n)
	}
	if code, err := p.Stop(30 * time.Second); err != nil || code != 0 {
		t.Fatalf("poller stopped with %d, %v", code, err)
	}
}

// insertArgs are the arguments of one of writerSetColumns: the new row's
// event id, and the earlier row's when it copies one.
func insertArgs(insert, id, earlier string) []any {
	if strings.Contains(insert, "$2") {
		return []any{id, earlier}
	}
	return []any{id}
}

// Issue 51, item 9: the snapshot strategy's /poll said `last_claim_at`, a
// lease word, for a strategy that claims nothing, and it never set
// outbox_relay_quarantined_events, so the alert on it could not fire for
// it. /poll now speaks of reads and of the snapshot's own state, and
// both strategies set the gauge from the quarantine table, as the WAL
// path does.
func TestPollQuarantinedGaugeAndAdminWordsForEachStrategy(t *testing.T) {
	for _, strategy := range []string{"lease", "snapshot"} {
		t.Run(strategy, func(t *testing.T) {
			var e *env
			if strategy == "snapshot" {
				e = newSnapEnv(t)
			} else {
				e = newEnv(t)
			}
			fault := e.Kafka.FailProduceTo("outbox.event.poison", -1, kerr.TopicAuthorizationFailed.Code)
			defer fault.Remove()
			p := e.startPoller("--poll-strategy", strategy)
			if err := e.Commit(t.Context(), e.DB.Connect(t), []harness.OutboxEvent{
				{AggregateType: "poison", AggregateID: "p-1", EventType: "Refused", Payload: `{}`},
			}); err != nil {
				t.Fatal(err)
			}
			harness.WaitFor(t, 30*time.Second, "outbox_relay_quarantined_events counts the refused event", func() bool {
				return harness.Metric(t, p.AdminURL(t), "outbox_relay_quarantined_events") == 1
			})
			_, body := harness.HTTPGet(t, p.AdminURL(t)+"/poll")
			want, unwanted := []string{`"strategy": "lease"`, `"last_claim_at"`, `"worker_id"`}, []string{`"last_read_at"`}
			if strategy == "snapshot" {
				want, unwanted = []string{`"strategy": "snapshot"`, `"last_read_at"`}, []string{`"last_claim_at"`, `"worker_id"`, `"leased"`}
				harness.WaitFor(t, 30*time.Second, "/poll shows the snapshot's state", func() bool {
					_, body = harness.HTTPGet(t, p.AdminURL(t)+"/poll")
					return strings.Contains(body, `"pending_rows": 0`)
				})
			}
			for _, w := range want {
				if !strings.Contains(body, w) {
					t.Errorf("/poll lacks %s:\n%s", w, body)
				}
			}
			for _, u := range unwanted {
				if strings.Contains(body, u) {
					t.Errorf("/poll of the %s strategy says %s:\n%s", strategy, u, body)
				}
			}
		})
	}
}
