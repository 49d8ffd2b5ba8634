package poll_test

import (
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// logDead is what a poller says when it takes one of its PostgreSQL
// connections for dead.
const logDead = "taking it for dead"

// deadPGTimeout is the drills' --pg-timeout: a dead connection must be
// noticed within it (plus the slack of a shared machine).
const deadPGTimeout = 6 * time.Second

// deadSlack is what a loaded machine may add to the bound.
const deadSlack = 2 * time.Second

// blackHoleCase is one poller black-hole drill: a strategy, and the
// writer's pace (idle-ish: the poller waits between rows; busy: it claims
// or reads back to back).
type blackHoleCase struct {
	strategy string
	pace     time.Duration
}

// blackHoleWorld starts a world whose pollers reach PostgreSQL through a
// toxiproxy each, the writer and the checks directly.
func blackHoleWorld(t *testing.T, strategy string) *world {
	t.Helper()
	db := cluster.CreateTestDatabase(t)
	var e *env
	if strategy == "snapshot" {
		e = newSnapEnvOn(t, db)
	} else {
		e = newEnvOn(t, db)
	}
	w := &world{env: e, rng: mrand.New(mrand.NewPCG(harness.DrillSeed(t), 0))}
	if strategy == "lease" {
		w.logClaims()
	}
	return w
}

// proxiedPoller starts a poller of strategy whose PostgreSQL connections
// all cross a toxiproxy of their own, and waits until it prints want.
func (w *world) proxiedPoller(strategy, want string) (*harness.Process, *harness.Toxi) {
	w.T.Helper()
	upstream := fmt.Sprintf("127.0.0.1:%d", cluster.Port())
	toxi := harness.StartToxi(w.T, upstream)
	dsn := strings.Replace(w.DB.DSN(), upstream, toxi.Addr(), 1)
	if dsn == w.DB.DSN() {
		w.T.Fatalf("could not point the DSN %s at the proxy", w.DB.DSN())
	}
	args := []string{"--poll-strategy", strategy, "--poll-batch", fmt.Sprint(drillBatch), "--pg-timeout", deadPGTimeout.String()}
	args = append(w.pollArgs(args...), "--pg-dsn", dsn+"&connect_timeout=3")
	p := harness.StartProcess(w.T, w.Bin, args, []string{harness.LogLevelInfo})
	p.WaitForOutput(w.T, want, time.Minute)
	return p, toxi
}

func claimed(t *testing.T, p *harness.Process) float64 {
	t.Helper()
	return harness.Metric(t, p.AdminURL(t), "outbox_relay_poll_rows_claimed_total")
}

func readyzStatus(t *testing.T, p *harness.Process) int {
	t.Helper()
	status, _ := harness.HTTPGet(t, p.AdminURL(t)+"/readyz")
	return status
}

// TestDrillPollBlackHole black-holes every connection between a poller
// and PostgreSQL (no FIN, no RST: toxiproxy drops everything both ways and
// passes no close on) while a writer commits, with the poller idle-ish
// (about 20 events/s: it waits between rows) and busy, for each strategy.
// The poller must take a connection for dead within --pg-timeout, saying
// so, be not ready meanwhile, poll again once the network lets it, and
// lose nothing, per-aggregate order kept. Before, an idle poller never
// noticed: its claim or read waited for ever.
func TestDrillPollBlackHole(t *testing.T) {
	cases := []blackHoleCase{{"lease", 150 * time.Millisecond}, {"snapshot", 150 * time.Millisecond},
		{"lease", 5 * time.Millisecond}, {"snapshot", 5 * time.Millisecond}}
	// Full size: a longer run before the hole.
	before := float64(harness.Sized(100, 2000))
	for _, c := range cases {
		load := "idle"
		if c.pace < 50*time.Millisecond {
			load = "busy"
		}
		t.Run(c.strategy+"/"+load, func(t *testing.T) {
			w := blackHoleWorld(t, c.strategy)
			poller, toxi := w.proxiedPoller(c.strategy, `"message":"polling"`)
			w.pollers = []*harness.Process{poller}
			wr := w.startWriter(w.DB.DSN(), c.pace, 20)
			halted := false
			defer func() {
				if !halted {
					wr.halt()
				}
			}()
			harness.WaitFor(t, 2*time.Minute, "the poller publishes", func() bool { return claimed(t, poller) >= before })

			failures := strings.Count(poller.Output(), logDead)
			if failures > 0 {
				t.Errorf("the poller took a live connection for dead:\n%s", poller.Output())
			}
			polls := strings.Count(poller.Output(), `"message":"polling"`)
			toxi.BlackHole(t)
			holed := time.Now()
			harness.WaitFor(t, deadPGTimeout+deadSlack+10*time.Second, "the poller takes a connection for dead", func() bool {
				return poller.Exited() || strings.Count(poller.Output(), logDead) > failures
			})
			detected := time.Since(holed)
			if poller.Exited() {
				t.Fatalf("poller exited behind the black hole:\n%s", poller.Output())
			}
			if status := readyzStatus(t, poller); status == http.StatusOK {
				t.Errorf("/readyz answered %d after the poller took its connection for dead; want not ready", status)
			}
			toxi.Heal(t)
			healed := time.Now()
			harness.WaitFor(t, time.Minute, "the poller polls again", func() bool {
				return poller.Exited() || strings.Count(poller.Output(), `"message":"polling"`) > polls
			})
			again := time.Since(healed)
			if detected > deadPGTimeout+deadSlack {
				t.Errorf("the dead connection was noticed after %v, want within --pg-timeout (%v)", detected, deadPGTimeout)
			}
			line := lastLineWith(poller.Output(), logDead)
			for _, want := range []string{"--pg-timeout", "connecting again"} {
				if !strings.Contains(line, want) {
					t.Errorf("the poller's message does not say %q: %s", want, line)
				}
			}
			halted = true
			halted = true
			if err := wr.halt(); err != nil {
				t.Fatal(err)
			}
			records := w.ConsumeAll(3 * time.Minute)
			dups := len(records) - w.CommittedCount()
			if c.strategy == "lease" {
				w.checkLeases()
			}
			t.Logf("%s %s: black hole noticed after %v (%s), polling again %v after the network healed; %d events, %d records, %d duplicates, 0 lost, order kept",
				c.strategy, load, detected.Round(100*time.Millisecond), firstWords(line), again.Round(100*time.Millisecond),
				w.CommittedCount(), len(records), dups)
		})
	}
}

// TestDrillSnapshotActiveBlackHoledWithStandby black-holes only the active
// snapshot poller's link (each poller has a proxy of its own) while a
// writer commits: the active one must stop publishing within --pg-timeout;
// the standby takes over only once PostgreSQL releases the lock. Behind a
// proxy the server's side of the connection stays alive, so PostgreSQL
// keeps the lock until the heal closes it. The two never publish at once.
func TestDrillSnapshotActiveBlackHoledWithStandby(t *testing.T) {
	w := blackHoleWorld(t, "snapshot")
	active, toxi := w.proxiedPoller("snapshot", `"message":"polling"`)
	standby, _ := w.proxiedPoller("snapshot", "waiting as its standby")
	w.pollers = []*harness.Process{active, standby}
	wr := w.startWriter(w.DB.DSN(), 50*time.Millisecond, 20)
	halted := false
	defer func() {
		if !halted {
			wr.halt()
		}
	}()
	harness.WaitFor(t, time.Minute, "the active poller publishes", func() bool { return claimed(t, active) >= 100 })

	toxi.BlackHole(t)
	holed := time.Now()
	harness.WaitFor(t, deadPGTimeout+deadSlack+10*time.Second, "the active poller takes its connection for dead", func() bool {
		return active.Exited() || strings.Contains(active.Output(), logDead)
	})
	detected := time.Since(holed)
	stoppedAt := claimed(t, active)
	// The hole lasts twice the bound more: long enough for a server that
	// noticed the session gone to hand the lock over.
	hold := time.NewTimer(2 * deadPGTimeout)
	<-hold.C
	if n := claimed(t, active); n != stoppedAt {
		t.Errorf("the black-holed poller claimed %v more rows after it took its connection for dead", n-stoppedAt)
	}
	tookOver := strings.Contains(standby.Output(), `"message":"polling"`)
	toxi.Heal(t)
	healed := time.Now()
	harness.WaitFor(t, time.Minute, "a poller polls again", func() bool {
		return strings.Count(active.Output(), `"message":"polling"`) > 1 || strings.Contains(standby.Output(), `"message":"polling"`)
	})
	again := time.Since(healed)
	if detected > deadPGTimeout+deadSlack {
		t.Errorf("the active poller noticed its dead connection after %v, want within --pg-timeout (%v)", detected, deadPGTimeout)
	}
	halted = true
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	records := w.ConsumeAll(3 * time.Minute)
	dups := len(records) - w.CommittedCount()
	steps := stepBacks(w, records)
	who := "the healed active poller"
	if strings.Contains(standby.Output(), `"message":"polling"`) {
		who = "the standby"
	}
	t.Logf("active stopped after %v (claimed nothing more); standby took over during the hole: %v; polling again %v after the heal (%s); %d events, %d records, %d duplicates, %d per-aggregate steps back (re-sent pages), 0 lost, order of first delivery kept",
		detected.Round(100*time.Millisecond), tookOver, again.Round(100*time.Millisecond), who, w.CommittedCount(), len(records), dups, steps)
	if steps > dups {
		t.Errorf("%d per-aggregate steps back with %d duplicates: an aggregate went back without a re-sent event, two pollers published at once", steps, dups)
	}
}

// stepBacks counts the records, in each partition's order, whose event
// comes before one already read of its aggregate: a re-sent page, or two
// publishers at once.
func stepBacks(w *world, records []harness.Record) int {
	_, order := w.Committed()
	at := map[string]int{}
	aggOf := map[string]string{}
	for agg, ids := range order {
		for i, id := range ids {
			at[id], aggOf[id] = i, agg
		}
	}
	sorted := slices.Clone(records)
	sort.SliceStable(sorted, func(i, j int) bool {
		if sorted[i].Partition != sorted[j].Partition {
			return sorted[i].Partition < sorted[j].Partition
		}
		return sorted[i].Offset < sorted[j].Offset
	})
	last := map[string]int{}
	steps := 0
	for _, r := range sorted {
		id := r.EventID()
		agg, ok := aggOf[id]
		if !ok {
			continue
		}
		if prev, seen := last[agg]; seen && at[id] < prev {
			steps++
		}
		last[agg] = at[id]
	}
	return steps
}

// lastLineWith is the last log line holding substr, "" if none.
func lastLineWith(out, substr string) string {
	line := ""
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, substr) {
			line = l
		}
	}
	return line
}

// firstWords is the start of a log line's error, for the drill's summary.
func firstWords(line string) string {
	var l struct {
		Error string `json:"error"`
	}
	if json.Unmarshal([]byte(line), &l) != nil || l.Error == "" {
		return line
	}
	if len(l.Error) > 90 {
		return l.Error[:90] + "…"
	}
	return l.Error
}
