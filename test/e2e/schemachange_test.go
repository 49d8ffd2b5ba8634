package e2e

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// insertUnderRenamedColumn renames aggregate_id, commits one row under the
// new name, and renames it back, each in its own transaction as an
// operator's mistake would be. It returns the row's event id and the WAL
// positions before and after it.
func (e *env) insertUnderRenamedColumn(conn *pgx.Conn) (eventID, before, after string) {
	e.T.Helper()
	ctx := context.Background()
	eventID = harness.NewUUID()
	before = e.DB.CurrentLSN(e.T)
	for _, sql := range []string{
		"ALTER TABLE outbox_events RENAME COLUMN aggregate_id TO agg_id",
		"INSERT INTO outbox_events (event_id, aggregate_type, agg_id, event_type, payload) VALUES ('" + eventID + `', 'order', 'agg-renamed', 'Renamed', '{"n": 0}')`,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			e.T.Fatalf("%s: %v", sql, err)
		}
	}
	after = e.DB.CurrentLSN(e.T)
	if _, err := conn.Exec(ctx, "ALTER TABLE outbox_events RENAME COLUMN agg_id TO aggregate_id"); err != nil {
		e.T.Fatal(err)
	}
	return eventID, before, after
}

var walPosition = regexp.MustCompile(`WAL position ([0-9A-F]+/[0-9A-F]+)`)

// checkRowPosition checks msg names the row's real WAL position, between
// before and after.
func checkRowPosition(t *testing.T, msg, before, after string) {
	t.Helper()
	m := walPosition.FindStringSubmatch(msg)
	if m == nil || !harness.LSNAtMost(before, m[1]) || !harness.LSNAtMost(m[1], after) {
		t.Errorf("%q does not name the row's WAL position (between %s and %s)", msg, before, after)
	}
}

// Issue 24.2: after `ALTER TABLE outbox_events RENAME COLUMN aggregate_id
// TO agg_id`, one insert, and the rename undone, the relay looped forever
// on `decode pgoutput message at 0/0: ... has no column "aggregate_id"`:
// the WAL holds that row with the old columns, so no session could pass
// it, and every later event was stuck. The row is now quarantined whole
// with the reason and its WAL position, and the stream goes on, across a
// restart too.
func TestRowWrittenUnderRenamedColumnIsQuarantinedAndStreamGoesOn(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	p := e.StartRelay()
	conn := e.DB.Connect(t)
	if err := e.writeEvents(conn, 1, 1, 1); err != nil {
		t.Fatal(err)
	}
	e.ConsumeAll(time.Minute)

	renamedID, before, after := e.insertUnderRenamedColumn(conn)
	if err := e.writeEvents(conn, 2, 2, 3); err != nil {
		t.Fatal(err)
	}
	e.ConsumeAll(time.Minute)
	if code, err := p.Stop(30 * time.Second); err != nil || code != 0 {
		t.Fatalf("relay stopped with %d (%v):\n%s", code, err, harness.LastLines(p.Output(), 20))
	}
	// A new process meets the old relation again only if the slot did not
	// pass the row; either way later events must flow.
	e.StartRelay()
	if err := e.writeEvents(conn, 2, 1, 3); err != nil {
		t.Fatal(err)
	}
	records := e.ConsumeAll(time.Minute)
	for _, r := range records {
		if r.EventID() == renamedID {
			t.Errorf("the row written under the renamed column reached Kafka: %s", r.Topic)
		}
	}

	var aggregateID, message string
	err := conn.QueryRow(context.Background(), "SELECT aggregate_id, error_message FROM outbox_quarantine WHERE event_id = $1", renamedID).Scan(&aggregateID, &message)
	if err != nil {
		t.Fatalf("the row written under the renamed column is not in the quarantine table: %v", err)
	}
	if !strings.Contains(message, `no column "aggregate_id"`) || !strings.Contains(message, "agg_id") {
		t.Errorf("quarantine reason %q does not name the missing column and the row's columns", message)
	}
	checkRowPosition(t, message, before, after)
}

// Issue 24.2, under --on-permanent-error halt: the relay stops at that row
// with its position and the way out, instead of looping; started once with
// the default policy it sets the row aside and goes on.
func TestRowWrittenUnderRenamedColumnHaltsNamingTheWayOut(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	p := e.StartRelay("--on-permanent-error", "halt")
	conn := e.DB.Connect(t)
	if err := e.writeEvents(conn, 1, 1, 1); err != nil {
		t.Fatal(err)
	}
	e.ConsumeAll(time.Minute)

	renamedID, before, after := e.insertUnderRenamedColumn(conn)
	code, err := p.Wait(time.Minute)
	if err != nil {
		t.Fatalf("relay under halt: %v; output tail:\n%s", err, harness.LastLines(p.Output(), 20))
	}
	out := p.Output()
	if code != 1 || !outputHas(out, renamedID, `no column \"aggregate_id\"`, "--on-permanent-error quarantine", "quarantine replay") {
		t.Fatalf("exit %d, want 1 naming the row, the missing column and the way out:\n%s", code, out)
	}
	if strings.Contains(out, "at 0/0") {
		t.Errorf("the error names position 0/0:\n%s", out)
	}
	if advice := sink.UnmappedRow(&event.Event{}, "", lsn.LSN(0)).Advice(); strings.Count(out, advice) != 1 {
		t.Errorf("the way out is not said exactly once (%d times):\n%s", strings.Count(out, advice), out)
	}
	checkRowPosition(t, out, before, after)

	e.StartRelay()
	if err := e.writeEvents(conn, 2, 1, 2); err != nil {
		t.Fatal(err)
	}
	e.ConsumeAll(time.Minute)
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE event_id = $1", renamedID); n != 1 {
		t.Errorf("quarantine holds %d rows of event %s, want 1", n, renamedID)
	}
}
