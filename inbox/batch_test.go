package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// A batch decides exactly what the same events handled one by one decide:
// duplicates (recorded before, or twice in one batch), stale versions, gaps
// parked and released, in order, whatever the batch boundaries. Random
// streams over a few aggregates, cut into random batches, are compared
// with Handle on a database of their own.
func TestInboxBatchDecidesAsOneByOne(t *testing.T) {
	ctx := context.Background()
	for seed := range uint64(6) {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 7))
			stream := randomStream(rng, 120)
			oneDB, oneConn := setup(t)
			batchDB, batchConn := setup(t)
			one := newInbox(t, inbox.Config{CheckVersions: true})
			batched := newInbox(t, inbox.Config{CheckVersions: true})
			var want, got []inbox.Result
			for _, e := range stream {
				want = append(want, mustHandle(t, one, oneConn, e))
			}
			for rest := stream; len(rest) > 0; {
				n := min(1+rng.IntN(40), len(rest))
				res, err := batched.HandleBatch(ctx, batchConn, rest[:n], recordEffect)
				if err != nil {
					t.Fatal(err)
				}
				if len(res) != n {
					t.Fatalf("%d results for a batch of %d", len(res), n)
				}
				got, rest = append(got, res...), rest[n:]
			}
			if !slices.Equal(got, want) {
				t.Fatalf("batched results differ from one by one:\n got  %v\n want %v", got, want)
			}
			if g, w := effects(t, batchDB), effects(t, oneDB); g != w {
				t.Fatalf("effects differ:\n batched    %s\n one by one %s", g, w)
			}
			if g, w := batched.Metrics().Counts(), one.Metrics().Counts(); g != w {
				t.Fatalf("counts differ: batched %+v, one by one %+v", g, w)
			}
			if w := one.Metrics().Counts(); w.Duplicates == 0 || w.StaleVersions == 0 || w.VersionGaps == 0 {
				t.Fatalf("the stream exercised too little: %+v", w)
			}
		})
	}
}

// randomStream is n deliveries over 4 aggregates: mostly each aggregate's
// next version, with re-deliveries of earlier events, versions delivered
// early (gaps), and the same version under a new event_id.
func randomStream(rng *rand.Rand, n int) []inbox.Event {
	next := map[string]int64{}
	var sent []inbox.Event
	for len(sent) < n {
		agg := fmt.Sprintf("a%d", rng.IntN(4))
		switch r := rng.IntN(10); {
		case r < 2 && len(sent) > 0:
			sent = append(sent, sent[rng.IntN(len(sent))])
		case r < 3:
			// The version after next: a gap until next arrives.
			sent = append(sent, ev(fmt.Sprintf("%s-v%d", agg, next[agg]+2), agg, next[agg]+2))
		case r < 4 && next[agg] > 0:
			sent = append(sent, ev(fmt.Sprintf("%s-v%d-again-%d", agg, next[agg], len(sent)), agg, next[agg]))
		default:
			next[agg]++
			sent = append(sent, ev(fmt.Sprintf("%s-v%d", agg, next[agg]), agg, next[agg]))
		}
	}
	return sent
}

// A handler that fails in the middle of a batch: the events before it are
// applied and committed, nothing after it is, and the error names it; the
// consumer hands the rest in again and each event is applied once, in
// order.
func TestInboxBatchHandlerFailsMidBatch(t *testing.T) {
	ctx := context.Background()
	for _, versions := range []bool{false, true} {
		t.Run(fmt.Sprintf("versions=%v", versions), func(t *testing.T) {
			db, conn := setup(t)
			ib := newInbox(t, inbox.Config{CheckVersions: versions})
			var batch []inbox.Event
			for i := range 10 {
				batch = append(batch, ev(fmt.Sprintf("e%d", i), fmt.Sprintf("a%d", i%3), int64(i/3+1)))
			}
			boom := errors.New("downstream refused")
			failing := true
			h := func(ctx context.Context, tx pgx.Tx, e inbox.Event) error {
				if err := recordEffect(ctx, tx, e); err != nil {
					return err
				}
				if e.ID == "e6" && failing {
					return boom
				}
				return nil
			}
			res, err := ib.HandleBatch(ctx, conn, batch, h)
			if !errors.Is(err, boom) || len(res) != 6 {
				t.Fatalf("got %d results and %v, want 6 results and the handler's error", len(res), err)
			}
			for i, r := range res {
				if r.Outcome != inbox.Applied {
					t.Fatalf("result %d: %v, want applied", i, r.Outcome)
				}
			}
			if got := effects(t, db); got != "e0,e1,e2,e3,e4,e5" {
				t.Fatalf("effects after the failure %q, want e0..e5", got)
			}
			failing = false
			res, err = ib.HandleBatch(ctx, conn, batch[len(res):], h)
			if err != nil || len(res) != 4 {
				t.Fatalf("the rest: %d results, %v", len(res), err)
			}
			if got := effects(t, db); got != "e0,e1,e2,e3,e4,e5,e6,e7,e8,e9" {
				t.Fatalf("effects %q, want each event once, in order", got)
			}
			if c := ib.Metrics().Counts(); c.HandlerErrors != 1 || c.Applied != 10 {
				t.Errorf("counts %+v, want 1 handler error (counted once though tried twice) and 10 applied", c)
			}
		})
	}
}

// An event without an event_id ends the batch there: the events before it
// are applied, and the error says why the rest was not.
func TestInboxBatchStopsAtAnEventWithoutID(t *testing.T) {
	db, conn := setup(t)
	ib := newInbox(t, inbox.Config{})
	res, err := ib.HandleBatch(context.Background(), conn, []inbox.Event{ev("e1", "a", 0), ev("", "a", 0), ev("e3", "a", 0)}, recordEffect)
	if !errors.Is(err, inbox.ErrNoEventID) || len(res) != 1 {
		t.Fatalf("got %d results and %v, want 1 and ErrNoEventID", len(res), err)
	}
	if got := effects(t, db); got != "e1" {
		t.Fatalf("effects %q, want e1", got)
	}
}
