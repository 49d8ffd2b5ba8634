package replication

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// TestParseTimelineHistory reads the history file of a server promoted
// twice, as TIMELINE_HISTORY 3 returns it (PostgreSQL writes the reason
// after a tab, and may add blank lines and comments).
func TestParseTimelineHistory(t *testing.T) {
	content := "1\t0/3000160\tno recovery target specified\n\n# comment\n2\t0/5A0B1C8\tbefore 2026-12-01 03:00:00+00\n"
	got, err := ParseTimelineHistory([]byte(content))
	if err != nil {
		t.Fatal(err)
	}
	want := []TimelineSwitch{{1, 0x3000160}, {2, 0x5A0B1C8}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("got %+v, want %+v", got, want)
	}
}

func TestParseTimelineHistoryRejects(t *testing.T) {
	for name, content := range map[string]string{
		"no switch point":     "1\n",
		"bad timeline":        "x\t0/1\treason\n",
		"zero timeline":       "0\t0/1\treason\n",
		"bad lsn":             "1\tzz\treason\n",
		"timeline goes back":  "2\t0/10\tr\n1\t0/20\tr\n",
		"switch goes back":    "1\t0/20\tr\n2\t0/10\tr\n",
		"repeated timeline":   "1\t0/10\tr\n1\t0/20\tr\n",
		"lsn without a slash": "1\t3000160\treason\n",
	} {
		if _, err := ParseTimelineHistory([]byte(content)); err == nil {
			t.Errorf("%s: %q parsed without error", name, content)
		}
	}
}

// TestBranchPoint pins how far a record's timeline agrees with the server:
// up to the switch point for an ancestor, without bound for the server's own
// timeline, and not at all for a timeline outside its history (a sibling
// branch, or a later timeline of an old primary).
func TestBranchPoint(t *testing.T) {
	sys := System{Timeline: 3, History: []TimelineSwitch{{1, 0x3000160}, {2, 0x5A0B1C8}}}
	cases := []struct {
		tli       uint32
		at        lsn.LSN
		unbounded bool
		ok        bool
	}{
		{3, 0, true, true},
		{1, 0x3000160, false, true},
		{2, 0x5A0B1C8, false, true},
		{4, 0, false, false},
		{7, 0, false, false},
	}
	for _, c := range cases {
		at, unbounded, ok := sys.BranchPoint(c.tli)
		if at != c.at || unbounded != c.unbounded || ok != c.ok {
			t.Errorf("BranchPoint(%d) = %s, %v, %v; want %s, %v, %v", c.tli, at, unbounded, ok, c.at, c.unbounded, c.ok)
		}
	}
	if _, unbounded, ok := (System{Timeline: 1}).BranchPoint(1); !ok || !unbounded {
		t.Error("timeline 1 without history must match itself without bound")
	}
}

// The --slot-failover refusal said "this server is 15.0" for 15.18 and
// "16.0" for 16.10: it split server_version_num as numbered before 10.
func TestReleaseName(t *testing.T) {
	for num, want := range map[int]string{150018: "15.18", 160010: "16.10", 170005: "17.5", 180001: "18.1", 100000: "10.0", 90624: "9.6.24"} {
		if got := releaseName(num); got != want {
			t.Errorf("releaseName(%d) = %q, want %q", num, got, want)
		}
	}
}
