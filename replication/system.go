package replication

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pglogrepl"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pg"
)

// System is what IDENTIFY_SYSTEM and TIMELINE_HISTORY say about the server:
// which cluster it is, which timeline it writes, how far its WAL reaches,
// and where each earlier timeline of its history ended.
type System struct {
	// ID is the cluster's system identifier. A base backup and a standby
	// keep it; a new initdb gets a new one.
	ID       string
	Timeline uint32
	// Flush is the server's current WAL flush position.
	Flush lsn.LSN
	// History lists the timelines before Timeline, oldest first; empty on
	// timeline 1.
	History []TimelineSwitch
}

// TimelineSwitch is one line of a timeline history file: timeline Parent
// ended at Switch, where its successor branched off.
type TimelineSwitch struct {
	Parent uint32
	Switch lsn.LSN
}

// IdentifySystem runs IDENTIFY_SYSTEM, and TIMELINE_HISTORY for the
// server's timeline when it has a history, on a short-lived replication
// connection.
func IdentifySystem(ctx context.Context, cfg Config) (System, error) {
	conn, err := pg.DialReplication(ctx, cfg.Config, nil)
	if err != nil {
		return System{}, err
	}
	defer conn.Close(context.Background())
	id, err := pglogrepl.IdentifySystem(ctx, conn)
	if err != nil {
		return System{}, fmt.Errorf("identify system: %w", err)
	}
	if id.Timeline < 1 {
		return System{}, fmt.Errorf("identify system: the server reports timeline %d", id.Timeline)
	}
	sys := System{ID: id.SystemID, Timeline: uint32(id.Timeline), Flush: lsn.LSN(id.XLogPos)}
	if sys.Timeline == 1 {
		return sys, nil // timeline 1 has no history file
	}
	hist, err := pglogrepl.TimelineHistory(ctx, conn, id.Timeline)
	if err != nil {
		return System{}, fmt.Errorf("read the history of timeline %d: %w", id.Timeline, err)
	}
	if sys.History, err = ParseTimelineHistory(hist.Content); err != nil {
		return System{}, fmt.Errorf("read the history of timeline %d: %w", id.Timeline, err)
	}
	return sys, nil
}

// ParseTimelineHistory reads a timeline history file: one line per earlier
// timeline, "parentTLI<TAB>switchpoint<TAB>reason", with blank lines and
// #-comments allowed, as PostgreSQL's readTimeLineHistory accepts.
func ParseTimelineHistory(content []byte) ([]TimelineSwitch, error) {
	var out []TimelineSwitch
	sc := bufio.NewScanner(bytes.NewReader(content))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) < 2 {
			return nil, fmt.Errorf("history line %d %q: want a timeline and a switch point", n, line)
		}
		tli, err := strconv.ParseUint(fields[0], 10, 32)
		if err != nil || tli == 0 {
			return nil, fmt.Errorf("history line %d: bad timeline %q", n, fields[0])
		}
		at, err := lsn.Parse(fields[1])
		if err != nil {
			return nil, fmt.Errorf("history line %d: %w", n, err)
		}
		if len(out) > 0 && (uint32(tli) <= out[len(out)-1].Parent || at < out[len(out)-1].Switch) {
			return nil, fmt.Errorf("history line %d: timelines must increase and switch points must not go back", n)
		}
		out = append(out, TimelineSwitch{Parent: uint32(tli), Switch: at})
	}
	return out, sc.Err()
}

// BranchPoint says how far the server's WAL agrees with timeline tli: WAL
// before the returned position is the same on both. It is unbounded
// (ok, with lsn 0 and unbounded true) when tli is the server's own
// timeline, the switch point where tli ended when tli is an ancestor, and
// not ok when tli is not in the server's history at all (a timeline of
// another branch, or a later one).
func (s System) BranchPoint(tli uint32) (at lsn.LSN, unbounded, ok bool) {
	if tli == s.Timeline {
		return 0, true, true
	}
	for _, sw := range s.History {
		if sw.Parent == tli {
			return sw.Switch, false, true
		}
	}
	return 0, false, false
}
