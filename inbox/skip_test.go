package inbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// A version that never came had no way out (issue 55, item 3): Overdue
// reported the gap, but nothing released the events parked behind it,
// and setting the stored version by hand did not help either, since a
// parked event is released only when exactly its predecessor is applied.
// SkipMissing records the missing versions as skipped and applies the
// parked events through the handler, in order; a later version applies
// as usual, and the skipped one, should it come after all, is stale.
func TestInboxSkipMissingReleasesWhatWaits(t *testing.T) {
	ctx := context.Background()
	db, conn := setup(t)
	now := time.Date(2026, 12, 7, 10, 0, 0, 0, time.UTC)
	ib := newInbox(t, inbox.Config{CheckVersions: true, MissingAfter: time.Minute, Now: func() time.Time { return now }})
	mustHandle(t, ib, conn, ev("a1", "a", 1))
	mustHandle(t, ib, conn, ev("a2", "a", 2))
	for _, e := range []inbox.Event{ev("a5", "a", 5), ev("a6", "a", 6)} {
		if r := mustHandle(t, ib, conn, e); r.Outcome != inbox.Parked {
			t.Fatalf("%s: %v, want parked", e.ID, r.Outcome)
		}
	}
	now = now.Add(2 * time.Minute)
	overdue, err := ib.Overdue(ctx, conn)
	if err != nil || len(overdue) != 1 || overdue[0].Applied != 2 || overdue[0].Waiting != 5 {
		t.Fatalf("overdue %+v, %v; want a waiting for 3 and 4", overdue, err)
	}

	for _, c := range []struct {
		through int64
		reason  string
		want    string
	}{
		{4, "", "give a reason"},
		{4, "  ", "give a reason"},
		{2, "INC-7", "version 2 is applied already"},
		{5, "INC-7", "version 5 is parked, not missing: skip through 4 at most"},
	} {
		if _, err := ib.SkipMissing(ctx, conn, "account", "a", c.through, c.reason, recordEffect); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("SkipMissing through %d, reason %q: %v, want %q", c.through, c.reason, err, c.want)
		}
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_skipped`); n != 0 {
		t.Fatalf("a refused skip recorded %d rows", n)
	}

	m := overdue[0]
	skip, err := ib.SkipMissing(ctx, conn, m.AggregateType, m.AggregateID, m.Waiting-1, "INC-7: versions 3 and 4 were never written", recordEffect)
	if err != nil {
		t.Fatal(err)
	}
	if want := (inbox.Skip{From: 3, Through: 4, Released: 2, Version: 6}); skip != want {
		t.Fatalf("skip %+v, want %+v", skip, want)
	}
	if got := effects(t, db); got != "a1,a2,a5,a6" {
		t.Fatalf("effects %q, want a1,a2,a5,a6", got)
	}
	if got := db.QueryString(t, `SELECT string_agg(version || ':' || reason, ',' ORDER BY version) FROM inbox_skipped
		WHERE consumer = 'billing' AND aggregate_type = 'account' AND aggregate_id = 'a'`); got != "3:INC-7: versions 3 and 4 were never written,4:INC-7: versions 3 and 4 were never written" {
		t.Fatalf("skipped rows %q", got)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM inbox_parked`); n != 0 {
		t.Fatalf("%d events still parked", n)
	}
	if overdue, err := ib.Overdue(ctx, conn); err != nil || len(overdue) != 0 {
		t.Fatalf("overdue after the skip: %+v, %v", overdue, err)
	}
	if r := mustHandle(t, ib, conn, ev("a3", "a", 3)); r.Outcome != inbox.Stale {
		t.Errorf("the skipped version arriving after all: %v, want stale", r.Outcome)
	}
	if r := mustHandle(t, ib, conn, ev("a7", "a", 7)); r.Outcome != inbox.Applied {
		t.Errorf("the next version: %v, want applied", r.Outcome)
	}
	if got := effects(t, db); got != "a1,a2,a5,a6,a7" {
		t.Fatalf("effects %q, want a1,a2,a5,a6,a7", got)
	}
	if c := ib.Metrics().Counts(); c.SkippedVersions != 2 || c.Applied != 5 {
		t.Errorf("counts %+v, want 2 skipped and 5 applied", c)
	}
}

// A hostile try of the runbook: under RefuseGaps a record without a type
// (CloudEvents, Debezium's shape) is refused naming no type, and the skip
// the runbook then gives, SkipMissing with the empty type, recorded
// versions under ” while the id's versions were kept under its type: the
// refused event kept failing. The empty type now resolves as such a
// record's does.
func TestInboxSkipMissingOfAnUntypedRecord(t *testing.T) {
	ctx := context.Background()
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{CheckVersions: true})
	mustHandle(t, ib, conn, ev("a1", "a", 1))
	if r := mustHandle(t, ib, conn, untyped("a4", "a", 4)); r.Outcome != inbox.Parked {
		t.Fatalf("a4: %v, want parked", r.Outcome)
	}
	skip, err := ib.SkipMissing(ctx, conn, "", "a", 3, "INC-8: versions 2 and 3 were never written", recordEffect)
	if err != nil {
		t.Fatal(err)
	}
	if want := (inbox.Skip{From: 2, Through: 3, Released: 1, Version: 4}); skip != want {
		t.Fatalf("skip %+v, want %+v", skip, want)
	}
	if got := db.QueryString(t, `SELECT string_agg(DISTINCT aggregate_type, ',') FROM inbox_skipped`); got != "account" {
		t.Errorf("skipped versions kept under type %q, want the id's own, account", got)
	}
	if got := effects(t, db); got != "a1,a4" {
		t.Errorf("effects %q, want a1,a4", got)
	}
	mustHandle(t, ib, conn, ev("a2b", "b", 1))
	mustHandle(t, ib, conn, inbox.Event{ID: "b-other", AggregateType: "other", AggregateID: "b", EventType: "X", Version: 1, Payload: []byte(`{}`)})
	if _, err := ib.SkipMissing(ctx, conn, "", "b", 3, "INC-9", recordEffect); err == nil || !strings.Contains(err.Error(), "name the one to skip") {
		t.Errorf("SkipMissing of an untyped id with versions under two types: %v, want a refusal naming them", err)
	}
}
