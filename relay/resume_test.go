package relay

import (
	"errors"
	"testing"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/replication"
)

// TestDecideStart pins every way a progress record may or may not move the
// start: it may only ever move it to a position whose events Kafka holds
// and this server's WAL has.
func TestDecideStart(t *testing.T) {
	tl1 := replication.System{ID: "7", Timeline: 1, Flush: 0x5000}
	// Promoted at 0x3000: timeline 1 ended there, timeline 2 goes on.
	tl2 := replication.System{ID: "7", Timeline: 2, Flush: 0x9000,
		History: []replication.TimelineSwitch{{Parent: 1, Switch: 0x3000}}}
	rec := func(at lsn.LSN, tli uint32) *progress.Record { return &progress.Record{LSN: at, Timeline: tli} }
	cases := []struct {
		name       string
		slot       lsn.LSN
		rec        *progress.Record
		sys        replication.System
		reset      bool
		start      lsn.LSN
		source     string
		orphanTo   lsn.LSN
		ignored    bool
		errAhead   bool
		orphanFrom lsn.LSN
		created    bool
		gapFrom    lsn.LSN
		gapTo      lsn.LSN
	}{
		// The slot went back after a PostgreSQL restart; Kafka has more.
		{name: "record ahead of the slot", slot: 0x1000, rec: rec(0x4000, 1), sys: tl1, start: 0x4000, source: StartFromProgress},
		{name: "no record", slot: 0x1000, sys: tl1, start: 0x1000, source: StartFromSlot},
		// The record lags (written at most once per status interval).
		{name: "record behind the slot", slot: 0x4800, rec: rec(0x4000, 1), sys: tl1, start: 0x4800, source: StartFromSlot},
		{name: "record at the server's end", slot: 0x1000, rec: rec(0x5000, 1), sys: tl1, start: 0x5000, source: StartFromProgress},
		// A restored base backup: same cluster, WAL ends before the record.
		{name: "record ahead of the WAL", slot: 0x1000, rec: rec(0x6000, 1), sys: tl1, errAhead: true},
		{name: "reset ignores it", slot: 0x1000, rec: rec(0x6000, 1), sys: tl1, reset: true, start: 0x1000, source: StartFromSlot, ignored: true},
		// A promoted standby: the old primary's record counts only up to
		// the branch point; what it wrote after may be orphaned in Kafka.
		{name: "old timeline past the branch", slot: 0x3500, rec: rec(0x3800, 1), sys: tl2, start: 0x3500, source: StartFromSlot, orphanFrom: 0x3000, orphanTo: 0x3800},
		{name: "old timeline past the branch, slot older", slot: 0x2000, rec: rec(0x3800, 1), sys: tl2, start: 0x3000, source: StartFromProgress, orphanFrom: 0x3000, orphanTo: 0x3800},
		{name: "old timeline before the branch", slot: 0x2000, rec: rec(0x2800, 1), sys: tl2, start: 0x2800, source: StartFromProgress},
		// Past the new primary's WAL end too: the timeline rule decides.
		{name: "old timeline past the new WAL end", slot: 0x3100, rec: rec(0xA000, 1), sys: tl2, start: 0x3100, source: StartFromSlot, orphanFrom: 0x3000, orphanTo: 0xA000},
		{name: "current timeline", slot: 0x3100, rec: rec(0x8000, 2), sys: tl2, start: 0x8000, source: StartFromProgress},
		// A record from a later or sibling timeline: this server is not
		// where Kafka's events came from.
		{name: "timeline not in history", slot: 0x1000, rec: rec(0x2000, 2), sys: tl1, errAhead: true},
		{name: "timeline not in history, reset", slot: 0x1000, rec: rec(0x2000, 2), sys: tl1, reset: true, start: 0x1000, source: StartFromSlot, ignored: true},
		// A slot created now, after what Kafka holds: a dropped slot, or a
		// failover to a server it was not synced to. What committed in
		// between was never streamed.
		{name: "slot created after the record", slot: 0x4800, created: true, rec: rec(0x4000, 1), sys: tl1, start: 0x4800, source: StartFromSlot, gapFrom: 0x4000, gapTo: 0x4800},
		{name: "slot created at the record", slot: 0x4000, created: true, rec: rec(0x4000, 1), sys: tl1, start: 0x4000, source: StartFromSlot},
		{name: "slot created before the record", slot: 0x1000, created: true, rec: rec(0x4000, 1), sys: tl1, start: 0x4000, source: StartFromProgress},
		{name: "slot created on a promoted standby", slot: 0x8000, created: true, rec: rec(0x3800, 1), sys: tl2, start: 0x8000, source: StartFromSlot, orphanFrom: 0x3000, orphanTo: 0x3800, gapFrom: 0x3000, gapTo: 0x8000},
		{name: "slot created, no record", slot: 0x4800, created: true, sys: tl1, start: 0x4800, source: StartFromSlot},
		{name: "slot created after the record, reset", slot: 0x4800, created: true, rec: rec(0x4000, 1), sys: tl1, reset: true, start: 0x4800, source: StartFromSlot, ignored: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d, err := decideStart(c.slot, c.created, c.rec, c.sys, c.reset)
			if c.errAhead {
				if !errors.Is(err, ErrProgressAhead) {
					t.Fatalf("want ErrProgressAhead, got %+v, %v", d, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d.Start != c.start || d.Source != c.source || (d.Ignored != "") != c.ignored ||
				d.OrphanFrom != c.orphanFrom || d.OrphanTo != c.orphanTo || d.GapFrom != c.gapFrom || d.GapTo != c.gapTo {
				t.Fatalf("got %+v; want start %s from %s, ignored %v, orphans (%s, %s], gap (%s, %s]", d, c.start, c.source, c.ignored, c.orphanFrom, c.orphanTo, c.gapFrom, c.gapTo)
			}
			if d.Start < c.slot {
				t.Fatalf("start %s before the slot %s", d.Start, c.slot)
			}
		})
	}
}
