package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// `make bench` takes minutes at full size and runs only on demand, so
// nothing else would notice a part of it breaking. This runs every part but
// the large transaction and the allocation benchmark (a `go test -bench` of
// its own, over a minute) at a tiny size against kfake, and checks that each
// part measured what it reports. The numbers themselves mean nothing here.
func TestBenchRunsEveryPartAtReducedSize(t *testing.T) {
	if testing.Short() {
		t.Skip("starts PostgreSQL, kfake and relays: not a short test")
	}
	dir := t.TempDir()
	bench := filepath.Join(dir, "bench")
	if out, err := exec.Command("go", "build", "-o", bench, ".").CombinedOutput(); err != nil {
		t.Fatalf("build the bench: %v\n%s", err, out)
	}
	results := filepath.Join(dir, "results")
	const rows = 1000
	cmd := exec.Command(bench, "--rows", strconv.Itoa(rows), "--reconcile-rows", strconv.Itoa(rows), "--writer-events", strconv.Itoa(rows), "--inbox-events", strconv.Itoa(rows), "--tracing-rows", strconv.Itoa(rows), "--broker", "kfake",
		"--skip", "bigtxn,allocs", "--rates", "500", "--latency-duration", "3s",
		"--steady-rates", "500", "--steady-duration", "2s", "--steady-warmup", "0s",
		"--poll-rates", "500", "--poll-idle", "2s",
		"--relay-bin", harness.BuildRelay(t), "--out", results, "--note", "reduced-size check")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, out)
	}

	raw, err := os.ReadFile(filepath.Join(results, "latest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var r Results
	if err := json.Unmarshal(raw, &r); err != nil {
		t.Fatalf("latest.json: %v", err)
	}
	md, err := os.ReadFile(filepath.Join(results, "latest.md"))
	if err != nil {
		t.Fatal(err)
	}
	hist, err := os.ReadFile(filepath.Join(results, "history.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range unmeasured(r, rows, string(md), string(hist)) {
		t.Error(p)
	}
}

// unmeasured lists what a reduced-size run of every part failed to
// measure: one line per part, run and value.
func unmeasured(r Results, rows int, md, hist string) []string {
	var out []string
	bad := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	if len(r.Problems) > 0 {
		bad("the bench reported problems: %q", r.Problems)
	}

	if len(r.Ceiling) != 2 {
		bad("catch-up measured %d shapes, want 2", len(r.Ceiling))
	}
	for _, sh := range r.Ceiling {
		readers := map[string]bool{}
		for _, run := range sh.Runs {
			readers[run.label()] = true
			if run.Events != rows || run.EventsPerSec <= 0 {
				bad("%s, %s: %d events at %.0f/s; want all %d drained", sh.Shape, run.label(), run.Events, run.EventsPerSec, rows)
			}
			if run.Reader == "relay/kfake" && (run.CPUUsPerEvent <= 0 || run.PeakRSSMB <= 0) {
				bad("%s, %s: CPU %.1f µs/event, peak RSS %.1f MB; want both measured", sh.Shape, run.label(), run.CPUUsPerEvent, run.PeakRSSMB)
			}
			if run.Reader == "relay/kfake" && (run.FirstConfirmAfter <= 0 || run.FirstVisibleAfter <= 0) {
				bad("%s, %s: first confirm %.3fs, first visible %.3fs; want both measured", sh.Shape, run.label(), run.FirstConfirmAfter, run.FirstVisibleAfter)
			}
			if strings.HasPrefix(run.Reader, "relay/") && run.Rep < 1 {
				bad("%s, %s: repetition %d reported; the warm-up drain must be discarded", sh.Shape, run.label(), run.Rep)
			}
		}
		for _, want := range []string{"pg_recvlogical", "pg_recvlogical [after]", "relay/kfake", "relay/kfake [exactly-once]"} {
			if !readers[want] {
				bad("%s: no %s drain among %v", sh.Shape, want, readers)
			}
		}
	}
	catchUp, firstCommit := 0, 0
	for _, tr := range r.Targets {
		if strings.HasPrefix(tr.Metric, "exactly-once catch-up ÷ at-least-once") {
			catchUp++
			if len(tr.Values) == 0 || tr.Values[0] <= 0 {
				bad("%s: %v; want a measured ratio", tr.Metric, tr.Values)
			}
		}
		if strings.HasPrefix(tr.Metric, "exactly-once first Kafka commit catching up") {
			firstCommit++
		}
	}
	if catchUp != len(r.Ceiling) || firstCommit != len(r.Ceiling) {
		bad("%d exactly-once catch-up ratios and %d first commits for %d shapes", catchUp, firstCommit, len(r.Ceiling))
	}

	for part, phases := range map[string][]LatencyResult{"live latency": r.Latency, "producer floor": r.Floor} {
		if len(phases) != 1 || len(phases[0].Phases) != 1 || phases[0].Phases[0].Measured == 0 {
			bad("%s: want one broker with one measured rate, got %+v", part, phases)
		}
	}

	if r.Steady == nil {
		bad("no steady-rate part")
	} else {
		steady := map[string]SteadyRun{}
		for _, run := range r.Steady.Runs {
			steady[run.Reader] = run
		}
		for _, reader := range []string{"pg_recvlogical", "floor-sarama/kfake", "floor-franz-go/kfake", "relay/kfake"} {
			if run, ok := steady[reader]; !ok || run.Rate != 500 || run.Events == 0 || run.CPUUsPerEvent <= 0 {
				bad("steady rate, %s: %+v; want a measured run at 500/s", reader, run)
			}
		}
		if run := steady["relay/kfake"]; run.P99Ms <= 0 || run.BrokerCPUUsPerEvent <= 0 || run.PostgresCPUUsPerEvent <= 0 {
			bad("steady rate, relay: p99 %.2f ms, broker %.1f µs/event, PostgreSQL %.1f µs/event; want all measured", run.P99Ms, run.BrokerCPUUsPerEvent, run.PostgresCPUUsPerEvent)
		}
	}

	if r.EOS == nil {
		bad("no exactly-once part")
	} else {
		modes := map[string]bool{}
		for _, run := range r.EOS.Runs {
			if run.Events > 0 && run.P99Ms > 0 {
				modes[run.Mode] = true
			}
		}
		if !modes["at-least-once"] || !modes["exactly-once"] {
			bad("exactly-once part measured modes %v; want both", modes)
		}
	}

	if len(r.Reconcile) != 1 || !r.Reconcile[0].Correct {
		bad("reconcile part: %+v; want one correct run", r.Reconcile)
	}

	writer := map[string]WriterResult{}
	for _, x := range r.Writer {
		writer[x.Mode] = x
	}
	if x := writer["batch"]; x.Events != rows || x.EventsPerSec <= 0 || x.StatementsTxn != 1 {
		bad("writer part, batch: %+v; want %d events at one statement per transaction", x, rows)
	}
	if x := writer["single"]; x.Events != rows || x.EventsPerSec <= 0 || x.StatementsTxn != float64(x.PerTxn) {
		bad("writer part, one INSERT per event: %+v; want %d events at one statement per event", x, rows)
	}

	if len(r.Inbox) != len(inboxConsumers) {
		bad("inbox part: %d runs, want one per consumer (%d)", len(r.Inbox), len(inboxConsumers))
	}
	for _, x := range r.Inbox {
		if x.Events != rows || x.EventsPerSec <= 0 || x.RatioToNaive <= 0 {
			bad("inbox part, %s: %+v; want %d events and a ratio to the naive consumer", x.Consumer, x, rows)
		}
	}

	out = append(out, unmeasuredSources(r.Poll, "poll", []string{"wal", sourcePollLease, sourcePollSnapshot}, rows)...)
	out = append(out, unmeasuredSources(r.Messages, "messages", []string{"wal", "messages"}, rows)...)
	out = append(out, unmeasuredTracing(r.Tracing, rows)...)

	if !strings.Contains(hist, "reduced-size check") {
		bad("history.md lacks the run's line:\n%s", hist)
	}
	for _, heading := range []string{"## Ceiling", "## Exactly-once catch-up beside at-least-once", "## Live commit-to-ack latency", "## Producer floor", "## Steady rate", "## Exactly-once", "## Reconcile", "## Writer", "## Polling or CDC", "## Messages", "## Tracing cost"} {
		if !strings.Contains(md, "\n"+heading) {
			bad("latest.md has no section %q", heading)
		}
	}
	return out
}

// unmeasuredSources lists what a part that compares sources (poll,
// messages) failed to measure: for each source, the 500/s run and the
// catch-up, the sizes and the idle period.
func unmeasuredSources(p *PollResult, part string, sources []string, rows int) []string {
	if p == nil {
		return []string{"no " + part + " part"}
	}
	var out []string
	bad := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	for _, source := range sources {
		phases := map[string]PollRun{}
		for _, run := range p.Runs {
			if run.Source == source {
				phases[run.Phase] = run
			}
		}
		if run, ok := phases["500/s"]; !ok || run.Events == 0 || run.P99Ms <= 0 || run.RelayCPUUsPerEvent <= 0 || run.PostgresCPUUsPerEvent <= 0 || run.WALBytesPerEvent <= 0 {
			bad("%s part, %s at 500/s: %+v; want events, p99, relay and PostgreSQL CPU, WAL measured", part, source, run)
		}
		if run, ok := phases["catch-up"]; !ok || run.Events != rows || run.EventsPerSec <= 0 || run.RelayCPUUsPerEvent <= 0 || run.FillWALBytesPerEvent <= 0 {
			bad("%s part, %s catch-up: %+v; want %d events drained with CPU and WAL measured", part, source, run, rows)
		}
		sized, idled := false, false
		for _, s := range p.Sizes {
			// The messages source has no outbox rows to count or size.
			sized = sized || s.Source == source && (source == "messages" || s.Events > int64(rows) && s.OutboxBytes > 0) && (pollStrategies[source] == "" || s.StateBytes > 0)
		}
		for _, i := range p.Idle {
			idled = idled || i.Source == source && i.Seconds > 0 && i.PostgresCPUMsPS > 0
		}
		if !sized || !idled {
			bad("%s part, %s: sizes measured %v, idle period measured %v; want both", part, source, sized, idled)
		}
	}
	return out
}

// unmeasuredTracing lists what the tracing part failed to measure: each
// setting's catch-up and steady run, and spans exported when tracing is
// on.
func unmeasuredTracing(t *TracingResult, rows int) []string {
	if t == nil {
		return []string{"no tracing part"}
	}
	var out []string
	for _, setting := range []string{"tracing off", "tracing on", "sampled 1%"} {
		var drained, steady bool
		for _, d := range t.CatchUp {
			drained = drained || d.Variant == setting && d.Events == rows && d.EventsPerSec > 0 && d.CPUUsPerEvent > 0
		}
		for _, s := range t.Steady {
			steady = steady || s.Variant == setting && s.Events > 0 && s.CPUUsPerEvent > 0
		}
		if !drained || !steady {
			out = append(out, fmt.Sprintf("tracing part, %s: drained %v, steady run %v; want both measured", setting, drained, steady))
		}
	}
	if t.Spans["tracing on"] <= 0 || t.Spans["sampled 1%"] >= t.Spans["tracing on"] {
		out = append(out, fmt.Sprintf("tracing part: spans exported %v; want some with tracing on, fewer sampled at 1%%", t.Spans))
	}
	return out
}
