package drills

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillCrashTorture SIGKILLs the relay at random moments while a writer
// commits events over 1,000 aggregates, restarting it each time. It pins
// the core contract: the slot is confirmed only up to the end of a
// transaction whose every record Kafka acknowledged, along with all before
// it, so a crash at any moment re-delivers and never loses (risks: confirming
// a transaction's start LSN instead of its end, confirming a keepalive's
// WAL end while acks are pending, acks counted for the wrong transaction).
// It also pins the documented bound on duplicates (relay.Config: the
// in-flight limits "also bound the duplicates a crash can cause"): the
// events a killed life delivered but had not confirmed to PostgreSQL, which
// later lives re-deliver, must stay within --max-in-flight-events, plus
// what one status update covers: the update the relay wrote just before
// SIGKILL may never be read by the walsender (a socket closed with unread
// data is reset, and the server drops what was queued), which this drill
// has observed. A relay that also counts acknowledged-but-unreported events
// against the limit keeps that to one more limit's worth; one that reports
// only every --status-interval does not bound it at all.
//
// Reduced: 10,000 events, 5 kills; OUTBOX_RELAY_DRILL_SIZE=full: 50,000
// events, 20 kills.
func TestDrillCrashTorture(t *testing.T) {
	events := harness.Sized(10_000, 50_000)
	kills := harness.Sized(5, 20)
	const aggregates = 1000
	const bound = 2000         // --max-in-flight-events
	const perCrash = 2 * bound // the bound plus one status update's worth
	rng := newRand(t)
	began := time.Now()

	w, _ := newKfakeWorld(t, shared)
	off := newOffsets(t, w.Brokers)
	conn := w.connect()

	// The writer commits one chunk per round, so writing spans every kill
	// and each relay life has a backlog to work through when it dies. The
	// first chunk, a backlog of three times the in-flight bound, is
	// written before the relay starts.
	first := max(events/(kills+1), 3*bound)
	chunk := (events - first) / kills
	chunks := make(chan int, kills+1)
	writerSeed := rng.Uint64()
	wait := runWriter(func() error {
		wrng := mrand.New(mrand.NewPCG(writerSeed, 1))
		for n := range chunks {
			for n > 0 {
				size := min(n, 1+wrng.IntN(20))
				if err := w.Commit(context.Background(), conn, w.genEvents(wrng, size, aggregates)); err != nil {
					return err
				}
				n -= size
			}
		}
		return nil
	})
	closeChunks := sync.OnceFunc(func() { close(chunks) })
	defer func() {
		closeChunks()
		wait()
	}()

	chunks <- first
	harness.WaitFor(t, 2*time.Minute, "the first backlog is committed", func() bool { return w.CommittedCount() >= first })
	args := []string{"--max-in-flight-events", strconv.Itoa(bound)}
	relay := w.startRelayNoWait(args...)
	lifeStart := time.Now()
	var snapshots []map[string]int64
	delivered := int64(0)
	for i := 0; i < kills; i++ {
		if i > 0 {
			chunks <- chunk
		}
		// The first kill comes once the first life delivered two and a half
		// times the in-flight bound of the backlog: the duplicates it causes
		// stay within perCrash only if the relay reported its progress to
		// PostgreSQL in time. Later ones come at a random moment: while the
		// relay is still starting up (one kill in six), right after this
		// life first moved the slot (one in three: a crash just after a
		// confirm), or after it delivered a random share of a chunk.
		startSlot := w.ConfirmedFlush()
		target := int64(1 + rng.IntN(chunk))
		kind := "records"
		switch r := rng.IntN(6); {
		case i == 0:
			kind, target = "backlog", int64(5*bound/2)
		case r == 0:
			kind, target = "startup", 0
		case r <= 2:
			kind = "confirm"
		}
		if kind != "startup" {
			harness.WaitFor(t, 3*time.Minute, fmt.Sprintf("relay life %d reaches its kill moment (%s)", i+1, kind), func() bool {
				if relay.Exited() {
					return true
				}
				if kind == "confirm" {
					return w.ConfirmedFlush() != startSlot
				}
				m, err := off.read(w.topics())
				return err == nil && sumOffsets(m)-delivered >= target
			})
			if relay.Exited() {
				t.Fatalf("relay life %d exited on its own:\n%s", i+1, relay.Output())
			}
		}
		relay.Kill()
		snap := waitStableOffsets(t, off, w.topics())
		snapshots = append(snapshots, snap)
		t.Logf("kill %d (%s): life of %v, %d records; %d of %d events committed; slot at %s",
			i+1, kind, time.Since(lifeStart).Round(time.Millisecond), sumOffsets(snap)-delivered,
			w.CommittedCount(), events, w.ConfirmedFlush())
		delivered = sumOffsets(snap)
		relay = w.startRelayNoWait(args...)
		lifeStart = time.Now()
	}
	chunks <- events - first - (kills-1)*chunk
	closeChunks()
	if err := wait(); err != nil {
		t.Fatalf("writer: %v", err)
	}
	relay.WaitForOutput(t, harness.LogStreaming, 2*time.Minute)

	if got := w.CommittedCount(); got != events {
		t.Fatalf("writer committed %d events, want %d", got, events)
	}
	records := w.waitSettled(5 * time.Minute)
	w.checkDelivery(records)

	lives := splitLives(records, snapshots)
	total := len(records) - w.CommittedCount() // the settle marker is an event too
	worst := 0
	for i, l := range lives {
		if i < kills {
			worst = max(worst, l.Unconfirmed)
		}
		t.Logf("life %d: %d records, %d repeated within the life, %d left unconfirmed at its end (re-delivered later)",
			i+1, l.Records, l.RepeatedSelf, l.Unconfirmed)
		if i < kills && l.Unconfirmed > perCrash {
			t.Errorf("kill %d left %d delivered events unconfirmed, to be re-delivered: more than --max-in-flight-events %d "+
				"plus one status update's worth (%d)", i+1, l.Unconfirmed, bound, perCrash)
		}
		if i == kills && l.Unconfirmed > 0 {
			t.Errorf("the last life, never killed, left %d events to be re-delivered", l.Unconfirmed)
		}
	}
	if total > kills*bound {
		t.Errorf("%d duplicates after %d kills, more than kills x max-in-flight (%d)", total, kills, kills*bound)
	}
	t.Logf("crash torture: %d events, %d aggregates, %d kills, %d records, %d duplicates (worst crash %d, per-crash limit %d, in-flight bound %d), %v",
		events, aggregates, kills, len(records), total, worst, perCrash, bound, time.Since(began).Round(time.Millisecond))
}
