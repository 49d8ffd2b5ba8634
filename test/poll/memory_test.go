package poll_test

import (
	"fmt"
	mrand "math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// bigRows inserts n rows of about size bytes of payload each, over a few
// aggregates, in transactions of 10, and returns their event ids. The
// payload repeats a short text, so PostgreSQL stores it compressed and the
// backlog costs the test little disk; the relay gets every byte.
func (w *world) bigRows(n, size int) []string {
	w.T.Helper()
	var ids []string
	for done := 0; done < n; done += 10 {
		batch := min(10, n-done)
		got := w.DB.QueryString(w.T, `WITH ins AS (
			INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
			SELECT gen_random_uuid(), 'big', 'big-' || (i % 7), 'Large', jsonb_build_object('pad', repeat(md5(i::text), $2 / 32))
			FROM generate_series($1::int, $1::int + $3 - 1) i RETURNING event_id)
			SELECT string_agg(event_id::text, ',') FROM ins`, done, size, batch)
		ids = append(ids, strings.Split(got, ",")...)
	}
	return ids
}

// memoryWorld is a drill's world for the strategy, without the lease
// claim log (the snapshot strategy has no state table).
func memoryWorld(t *testing.T, strategy string) *world {
	t.Helper()
	e := newEnv(t)
	if strategy == "snapshot" {
		e = newSnapEnv(t)
	}
	return &world{env: e, rng: mrand.New(mrand.NewPCG(harness.DrillSeed(t), 0))}
}

// peakMiB is a process's peak resident set size, in MiB.
func peakMiB(t *testing.T, p *harness.Process) float64 {
	t.Helper()
	peak, err := harness.PeakRSS(p.Pid())
	if err != nil {
		t.Fatal(err)
	}
	return float64(peak) / (1 << 20)
}

// Issue 51, item 4: poll mode read a page of --poll-batch rows whatever
// their size, and the next page ahead: a backlog of 1,000 rows of about
// 1 MB peaked at 1.78 GB RSS with the snapshot strategy and 1.43 GB with
// the lease strategy, against the shipped unit's MemoryMax=1G (the WAL
// source: 66 MB). A page is now bounded by bytes too, a share of
// --max-in-flight-bytes, so memory is bounded by the in-flight window,
// not the backlog, as docs/memory-and-cpu.md promises for every source.
// A writer commits small events at a steady rate throughout; all of them
// and every large one are delivered, in order. Full size: 1,000 rows.
func TestDrillPollMemoryBoundedWithLargeEvents(t *testing.T) {
	const inFlight = 64 << 20 // --max-in-flight-bytes, the default
	for _, strategy := range []string{"lease", "snapshot"} {
		t.Run(strategy, func(t *testing.T) {
			w := memoryWorld(t, strategy)
			big := w.bigRows(harness.Sized(150, 1000), 900_000)
			wr := w.startWriter(w.DB.DSN(), 20*time.Millisecond, 50)
			p := w.startPoller("--poll-strategy", strategy)
			harness.ConsumeEventIDs(t, w.Kafka.Brokers(), `^outbox\.event\.big$`, big, 5*time.Minute)
			if err := wr.halt(); err != nil {
				t.Fatal(err)
			}
			w.drillCount(fmt.Sprintf("%s strategy, %d rows of 900 KB", strategy, len(big)))
			peak := peakMiB(t, p)
			// The in-flight window, held a few times over (the page
			// publishing, the next, and the Kafka client's copies), plus
			// the process's own.
			bound := 3*float64(inFlight)/(1<<20) + 64
			t.Logf("%s strategy: %d rows of 900 KB drained with a peak RSS (VmHWM) of %.0f MiB; bound %.0f MiB", strategy, len(big), peak, bound)
			if peak > bound {
				t.Errorf("peak RSS %.0f MiB with %d rows of 900 KB: over %.0f MiB; memory must be bounded by the in-flight window, not the backlog", peak, len(big), bound)
			}
		})
	}
}

// Issue 51, item 4: a row over --max-message-bytes was read whole (one
// of 100 MB peaked at 514 MB with --max-message-bytes 1000000) and
// copied whole into the quarantine table. Now its size is read first,
// and its values never: it is quarantined by reference (its id, size and
// why), and the row stays in the outbox table. A writer commits small
// events at a steady rate throughout; they are all delivered.
func TestDrillPollOversizeRowQuarantinedByReference(t *testing.T) {
	for _, strategy := range []string{"lease", "snapshot"} {
		t.Run(strategy, func(t *testing.T) {
			w := memoryWorld(t, strategy)
			huge := w.bigRows(1, 100_000_000)[0]
			wr := w.startWriter(w.DB.DSN(), 20*time.Millisecond, 50)
			p := w.startPoller("--poll-strategy", strategy, "--max-message-bytes", "1000000", "--kafka-max-message-bytes", "1000000")
			harness.WaitFor(t, 2*time.Minute, "the 100 MB row is quarantined", func() bool {
				return w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE event_id = $1", huge) == 1
			})
			waitFor := w.CommittedCount() + 100
			harness.WaitFor(t, time.Minute, "the writer goes on", func() bool { return w.CommittedCount() >= waitFor })
			if err := wr.halt(); err != nil {
				t.Fatal(err)
			}
			w.drillCount(strategy + " strategy, beside a 100 MB row")
			peak := peakMiB(t, p)
			size := w.DB.QueryInt64(t, "SELECT coalesce(raw_size, -1) FROM outbox_quarantine WHERE event_id = $1", huge)
			problem := w.DB.QueryString(t, "SELECT coalesce(content_problem, '') FROM outbox_quarantine WHERE event_id = $1", huge)
			payload := w.DB.QueryInt64(t, "SELECT coalesce(octet_length(payload::text), 0) FROM outbox_quarantine WHERE event_id = $1", huge)
			t.Logf("%s strategy: a 100 MB row quarantined with raw_size %d, %d payload bytes kept; peak RSS (VmHWM) %.0f MiB; content_problem: %s", strategy, size, payload, peak, problem)
			if size < 100_000_000 || problem == "" || payload != 0 {
				t.Errorf("quarantined with raw_size %d, content_problem %q and %d payload bytes: want it kept by reference (its size, why, no value)", size, problem, payload)
			}
			if peak > 100 {
				t.Errorf("peak RSS %.0f MiB: the 100 MB row's value was read", peak)
			}
		})
	}
}
