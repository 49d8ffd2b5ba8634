package inbox_test

import (
	"context"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// untyped is ev as a record without an aggregate type carries it: a
// CloudEvent (ce_subject) or Debezium's shape (the key).
func untyped(id, agg string, version int64) inbox.Event {
	e := ev(id, agg, version)
	e.AggregateType = ""
	return e
}

// Changing --record-format while consumers check versions parked the next
// event of every existing aggregate for ever (issue 55, item 4):
// CloudEvents and Debezium's shape carry no aggregate type, so the
// version key went from ("account", "a") to ("", "a"), where version 4
// found nothing applied and waited for versions 1 to 3. Now a record
// without a type uses its id's versions whatever their type, and a
// record with a type takes over what records without one kept, so both
// directions of the switch go on: in order, nothing parked for ever, a
// gap across the switch released, an aggregate born between two switches
// kept.
func TestInboxVersionsSurviveARecordFormatSwitch(t *testing.T) {
	ctx := context.Background()
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{CheckVersions: true})
	steps := []struct {
		e    inbox.Event
		want inbox.Outcome
	}{
		// The relay's format.
		{ev("a1", "a", 1), inbox.Applied},
		{ev("a2", "a", 2), inbox.Applied},
		{ev("a3", "a", 3), inbox.Applied},
		// Switched to CloudEvents: same aggregate, no type.
		{untyped("a4", "a", 4), inbox.Applied},
		{untyped("a6", "a", 6), inbox.Parked},
		{untyped("a5", "a", 5), inbox.Applied}, // releases a6
		{untyped("a5-again", "a", 5), inbox.Stale},
		// Born under CloudEvents, with a gap.
		{untyped("n1", "n", 1), inbox.Applied},
		{untyped("n3", "n", 3), inbox.Parked},
		// Switched back to the relay's format.
		{ev("a7", "a", 7), inbox.Applied},
		{ev("n2", "n", 2), inbox.Applied}, // takes over n's versions, releases n3
		{ev("n4", "n", 4), inbox.Applied},
		// And once more.
		{untyped("n5", "n", 5), inbox.Applied},
		{untyped("a8", "a", 8), inbox.Applied},
	}
	for _, s := range steps {
		r, err := ib.Handle(ctx, conn, s.e, recordEffect)
		if err != nil {
			t.Fatalf("%s: %v", s.e.ID, err)
		}
		if r.Outcome != s.want {
			t.Fatalf("%s (type %q, version %d): %v, want %v", s.e.ID, s.e.AggregateType, s.e.Version, r.Outcome, s.want)
		}
	}
	if got := effects(t, db); got != "a1,a2,a3,a4,a5,a6,n1,a7,n2,n3,n4,n5,a8" {
		t.Fatalf("effects %q", got)
	}
	if got := db.QueryString(t, `SELECT string_agg(aggregate_type || '/' || aggregate_id || '@' || version, ',' ORDER BY aggregate_id) FROM inbox_versions`); got != "account/a@8,account/n@5" {
		t.Errorf("versions %q, want one row per aggregate, under its type", got)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_parked`); n != 0 {
		t.Errorf("%d events parked", n)
	}
}

// The same switch in one batch: a partition's records change format
// between two records of one aggregate.
func TestInboxRecordFormatSwitchInsideABatch(t *testing.T) {
	ctx := context.Background()
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{CheckVersions: true})
	mustHandle(t, ib, conn, ev("a1", "a", 1))
	batch := []inbox.Event{ev("a2", "a", 2), untyped("a3", "a", 3), untyped("b1", "b", 1), ev("b2", "b", 2), untyped("a5", "a", 5), ev("a4", "a", 4)}
	res, err := ib.HandleBatch(ctx, conn, batch, recordEffect)
	if err != nil {
		t.Fatal(err)
	}
	want := []inbox.Outcome{inbox.Applied, inbox.Applied, inbox.Applied, inbox.Applied, inbox.Parked, inbox.Applied}
	for i, r := range res {
		if r.Outcome != want[i] {
			t.Fatalf("results %v, want %v", res, want)
		}
	}
	if got := effects(t, db); got != "a1,a2,a3,b1,b2,a4,a5" {
		t.Fatalf("effects %q", got)
	}
	if got := db.QueryString(t, `SELECT string_agg(aggregate_type || '/' || aggregate_id || '@' || version, ',' ORDER BY aggregate_id) FROM inbox_versions`); got != "account/a@5,account/b@2" {
		t.Errorf("versions %q", got)
	}
}

// An id with versions under two aggregate types cannot be told apart by a
// record without a type: refused, naming both, rather than applied
// against the wrong aggregate's versions.
func TestInboxUntypedRecordOfAnAmbiguousIDIsRefused(t *testing.T) {
	ctx := context.Background()
	_, conn := setup(t)
	ib := newInbox(t, inbox.Config{CheckVersions: true})
	mustHandle(t, ib, conn, ev("o1", "42", 1))
	other := ev("i1", "42", 1)
	other.AggregateType = "invoice"
	mustHandle(t, ib, conn, other)
	_, err := ib.Handle(ctx, conn, untyped("x2", "42", 2), recordEffect)
	if err == nil || !strings.Contains(err.Error(), `aggregate types ["account" "invoice"]`) {
		t.Fatalf("got %v, want the ambiguity named", err)
	}
}
