package doccheck

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// check writes a small module and the page, and returns the page's
// problems.
func check(t *testing.T, page string) []Problem {
	t.Helper()
	root := t.TempDir()
	files := map[string]string{
		"go.mod":     "module example.com/m\n\ngo 1.22\n",
		".gitignore": "/bin/\n/bench/runs/\n*.test\n",
		"relay/loop.go": `package relay

// Relay runs sessions.
type Relay struct{ cfg Config }

type statusSink interface{ alive() }

type loopEnv struct {
	clock clock
}

func (r *Relay) session() {}
`,
		"relay/seams.go": `package relay

type clock interface{ Now() }

// Config configures.
type Config struct{ DeliveryMode string }

// Session embeds its Config.
type Session struct {
	Config
	env *loopEnv
}

type table struct{ name string }
`,
		"relay/resume.go": `package relay

func decideStart() {}
`,
		"relay/progress.go": `package relay

func (r *Relay) resume() {}
`,
		"lsn/tracker.go": `package lsn

// Tracker tracks.
type Tracker struct{}

// Ack acks.
func (t *Tracker) Ack() {}

// New makes one.
func New() *Tracker { return nil }
`,
		"cmd/tool/main.go": "package main\n\nfunc main() {}\n",
	}
	for name, body := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(root, "docs"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "docs/page.md"), []byte(page), 0o644); err != nil {
		t.Fatal(err)
	}
	ix, err := LoadIndex(root)
	if err != nil {
		t.Fatal(err)
	}
	problems, err := CheckPage(ix, "docs/page.md")
	if err != nil {
		t.Fatal(err)
	}
	return problems
}

// wantOne asserts exactly one problem, on line, whose message holds each
// of parts.
func wantOne(t *testing.T, problems []Problem, line int, parts ...string) {
	t.Helper()
	if len(problems) != 1 {
		t.Fatalf("got %d problems, want 1: %v", len(problems), problems)
	}
	p := problems[0]
	msg := p.String()
	if p.Line != line {
		t.Errorf("problem on line %d, want %d: %s", p.Line, line, msg)
	}
	for _, s := range append(parts, "docs/page.md:", "rename it in the page or restore the code") {
		if !strings.Contains(msg, s) {
			t.Errorf("message %q does not hold %q", msg, s)
		}
	}
}

func TestMissingFileFails(t *testing.T) {
	wantOne(t, check(t, "# Page\n\nThe loop is in `relay/loop.go`;\nits fakes are in `relay/fakes_test.go`.\n"),
		4, "`relay/fakes_test.go`", "does not exist")
}

func TestMissingDirectoryInPackageTableFails(t *testing.T) {
	page := "| package | owns |\n|---|---|\n| `relay` | the loop |\n| `poll` | polling |\n| `cmd/tool` | the binary |\n"
	wantOne(t, check(t, page), 4, "`poll`", "does not exist")
}

func TestMissingFuncFails(t *testing.T) {
	wantOne(t, check(t, "# Page\n\nA session calls\n`drainAll()` before it ends.\n"),
		4, "`drainAll()`", "drainAll")
}

func TestMissingQualifiedNamesFail(t *testing.T) {
	page := "`lsn.Tracker` and `lsn.Tracker.Ack` exist.\n\n`lsn.Tracker.Nack` does not.\n\n`(*Relay).stream` does not either.\n\n`lsn.Gone` neither.\n"
	problems := check(t, page)
	if len(problems) != 3 {
		t.Fatalf("got %d problems, want 3: %v", len(problems), problems)
	}
	for i, want := range []string{"Nack", "stream", "Gone"} {
		if !strings.Contains(problems[i].Msg, want) {
			t.Errorf("problem %d is %q, want it to name %s", i, problems[i].Msg, want)
		}
	}
}

// A chain through fields is followed to its end: `readLoop.keeper.writtenn`
// passed when only two names were read.
func TestChainsThroughFieldsAreFollowed(t *testing.T) {
	page := "`Relay.cfg.DeliveryMode`, `loopEnv.clock.Now()`, `relay.Session.env.clock.Now`,\n" +
		"`relay.Session.DeliveryMode` (promoted), `Session.env.clock` and `Relay.cfg.DeliveryMode.Len` exist.\n" +
		"`table.field.event.id` and `Config.Group.Rebalance.Timeout` are other settings.\n" +
		"\n" +
		"`Relay.cfg.DeliveryModes` does not exist,\n" +
		"\n" +
		"`loopEnv.clock.Later()` neither,\n" +
		"\n" +
		"`relay.Session.envs.clock` nor `relay.Session.env.clok.Now`.\n"
	problems := check(t, page)
	want := []struct {
		line int
		name string
	}{{5, "Config has no method or field DeliveryModes"}, {7, "clock has no method or field Later"},
		{9, "Session has no method or field envs"}, {9, "loopEnv has no method or field clok"}}
	if len(problems) != len(want) {
		t.Fatalf("got %d problems, want %d: %v", len(problems), len(want), problems)
	}
	for i, w := range want {
		if problems[i].Line != w.line || !strings.Contains(problems[i].Msg, w.name) {
			t.Errorf("problem %d is %v, want line %d naming %q", i, problems[i], w.line, w.name)
		}
	}
}

// Issue 41.6: a bare name the page did not place was never checked, so a
// renamed type or field (`statusSinc`, `loopEnvs`) stayed in a page. A
// bare name in camelCase is Go by its shape and must be declared; one in
// one case (`streaming`, `REPLICATION`, `WatchdogSec`) may be anything
// else and is left alone.
func TestBareCamelCaseNamesMustExist(t *testing.T) {
	page := "`statusSink`, `loopEnv`, `decideStart` and `clock` exist; `streaming`, `REPLICATION` and `WatchdogSec` are not Go.\n" +
		"\n" +
		"`statusSinc` does not exist,\n" +
		"\n" +
		"nor `loopEnvs`.\n"
	problems := check(t, page)
	if len(problems) != 2 || problems[0].Line != 3 || !strings.Contains(problems[0].Msg, "statusSinc, which this module does not declare") ||
		problems[1].Line != 5 || !strings.Contains(problems[1].Msg, "loopEnvs") {
		t.Fatalf("problems %v, want statusSinc on line 3 and loopEnvs on line 5", problems)
	}
}

func TestMissingPlacedFuncFailsOnce(t *testing.T) {
	wantOne(t, check(t, "`drainAll()` in `relay/loop.go`\n"), 1, "`drainAll()`", "drainAll")
}

func TestFuncInWrongFileFails(t *testing.T) {
	wantOne(t, check(t, "# Page\n\nWhere a session starts:\n`resume()` in `relay/resume.go`.\n"),
		4, "`resume()`", "not declared in relay/resume.go", "relay/progress.go")
}

func TestTypeInWrongFileFails(t *testing.T) {
	// Both names are placed; only clock is elsewhere. The loopEnv field
	// named clock does not count as a declaration of clock.
	wantOne(t, check(t, "- `statusSink` and `clock` (`relay/loop.go`): the loop's time.\n"),
		1, "`clock`", "not declared in relay/loop.go", "relay/seams.go")
}

func TestPlacementForms(t *testing.T) {
	for _, page := range []string{
		"`relay/resume.go`: `resume`, `decideStart`\n",
		"`relay/progress.go: resume, session`\n",
		"`decideStart` in `lsn/`\n",
	} {
		problems := check(t, page)
		if len(problems) != 1 || !strings.Contains(problems[0].Msg, "not declared in") {
			t.Errorf("page %q: got %v, want one misplaced name", page, problems)
		}
	}
}

func TestLinePastEndFails(t *testing.T) {
	problems := check(t, "See `relay/resume.go:3`, then `relay/resume.go:4`.\n")
	wantOne(t, problems, 1, "`relay/resume.go:4`", "line 4", "has 3 lines")
}

func TestTruePagePasses(t *testing.T) {
	page := "# Page\n\n" +
		"The read loop, `streamer`, in `relay/loop.go` (`relay/loop.go:4`) takes a\n" +
		"`statusSink` (`relay/loop.go`) and a `clock` in `relay/seams.go`;\n" +
		"`(*Relay).session` and `Relay.resume` run it, `decideStart` (`relay/resume.go`)\n" +
		"decides where; `lsn.Tracker.Ack`, `*lsn.Tracker`, `lsn.New()`, `Now()` and\n" +
		"`relay.Config.DeliveryMode` exist; `cmd/tool/`, `cmd/tool`, `main.go`, `docs/page.md`.\n" +
		"\n" +
		"Not Go, not checked: `go test ./relay/`, `--slot`, `/readyz`, `GET /slot`,\n" +
		"`SELECT pg_drop_replication_slot('x')`, `pg_current_wal_lsn()`, `deriv()`,\n" +
		"`outbox_relay_events_published_total`, `relay.state`, `progress.commit_time`,\n" +
		"`cleanup.policy`, `pgx.Identifier`, `(*kgo.Client).PollFetches`, `NOTIFY`,\n" +
		"`~/.cache/outbox-relay/`, `/etc/outbox-relay/env`, `https://example.com/a/b`,\n" +
		"`github.com/twmb/franz-go`, `database/sql`, `bench/runs/`, `bin/outbox-relay`,\n" +
		"`{\"lsn\":\"0/16B3748\"}`, `FOR UPDATE SKIP LOCKED` (`relay/loop.go`).\n" +
		"\n" +
		"```\nrelay/nothing.go missing() (*Gone).x\n```\n" +
		"\n" +
		"| package | owns |\n|---|---|\n| `relay` | the loop; `missing` here is prose |\n| `lsn` | — |\n"
	if problems := check(t, page); len(problems) != 0 {
		t.Errorf("a true page got problems:\n%v", problems)
	}
}
