package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// Environment describes where the numbers come from.
type Environment struct {
	GoVersion   string `json:"go_version"`
	CPUs        int    `json:"cpus"`
	CPUModel    string `json:"cpu_model"`
	LoadAtStart string `json:"load_at_start"`
}

// Results is everything one run measured; it is written as latest.json.
type Results struct {
	Timestamp   string            `json:"timestamp"`
	Note        string            `json:"note"`
	Command     string            `json:"command"`
	Rows        int               `json:"rows"`
	Repeat      int               `json:"repeat"`
	Brokers     []string          `json:"brokers"`
	Settings    map[string]string `json:"settings"`
	Environment Environment       `json:"environment"`
	RelayBinary string            `json:"relay_binary"`
	Variants    []string          `json:"variants,omitempty"`
	Targets     []TargetRow       `json:"targets"`
	Ceiling     []ShapeResult     `json:"ceiling,omitempty"`
	BigTxn      *BigTxnResult     `json:"big_transaction,omitempty"`
	Latency     []LatencyResult   `json:"latency,omitempty"`
	// EOS is commit to a read_committed consumer, exactly-once next to
	// at-least-once.
	EOS *EOSResult `json:"exactly_once,omitempty"`
	// Floor is the publisher alone at the same rates, without PostgreSQL.
	Floor     []LatencyResult   `json:"producer_floor,omitempty"`
	Steady    *SteadyResult     `json:"steady,omitempty"`
	Allocs    []GoBenchResult   `json:"allocs,omitempty"`
	Reconcile []ReconcileResult `json:"reconcile,omitempty"`
	Writer    []WriterResult    `json:"writer,omitempty"`
	Inbox     []InboxResult     `json:"inbox,omitempty"`
	// Poll is the relay's two sources, WAL and poll mode, side by side.
	Poll *PollResult `json:"poll,omitempty"`
	// Messages is the messages source and the table source side by side.
	Messages *PollResult `json:"messages,omitempty"`
	// Tracing is the relay with tracing off, on and sampled at 1%.
	Tracing  *TracingResult `json:"tracing,omitempty"`
	Problems []string       `json:"problems,omitempty"`
	Duration string         `json:"duration"`
}

// TargetRow is one measured value against its target from the issue.
type TargetRow struct {
	Metric   string    `json:"metric"`
	Target   string    `json:"target"`
	Values   []float64 `json:"values"` // one per repetition
	Unit     string    `json:"unit"`
	Verdict  string    `json:"verdict"` // PASS, FAIL, MIXED (some repetitions pass)
	Comments string    `json:"comments,omitempty"`
}

func newResults(o *options) *Results {
	return &Results{
		Timestamp: time.Now().UTC().Format(time.RFC3339),
		Note:      o.note,
		Command:   commandLine(),
		Rows:      o.rows,
		Repeat:    o.repeat,
		Settings: map[string]string{
			"payload_bytes":   fmt.Sprint(o.payload),
			"aggregates":      fmt.Sprint(o.aggregates),
			"partitions":      fmt.Sprint(o.partitions),
			"postgres_fsync":  map[bool]string{true: "on", false: "off"}[o.pgFsync],
			"compression":     orDefault(o.compression, "relay default (lz4)"),
			"latency_per_run": o.latencyFor.String(),
			"relay_args":      o.extraRelayArg,
		},
	}
}

// commandLine is how the bench was started, quoted for a shell.
func commandLine() string {
	parts := []string{"go run ./test/bench"}
	for _, a := range os.Args[1:] {
		if a == "" || strings.ContainsAny(a, " \t'\"$;&|<>()*?[]#~`") {
			a = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		parts = append(parts, a)
	}
	return scrubPaths(strings.Join(parts, " "))
}

// absPath matches an absolute file path inside a command line or a list.
var absPath = regexp.MustCompile(`(^|[\s=,'])(?:/[^/\s,='"]+)+/([^/\s,='"]+)`)

// scrubPaths keeps only the last element of absolute paths, so results
// carry no machine-specific directories.
func scrubPaths(s string) string { return absPath.ReplaceAllString(s, "$1$2") }

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

// target appends a row; ok says whether one value meets the target.
func (r *Results) target(metric, target, unit string, values []float64, ok func(float64) bool, comments string) {
	if len(values) == 0 {
		return
	}
	pass := 0
	for _, v := range values {
		if ok(v) {
			pass++
		}
	}
	verdict := "MIXED"
	switch pass {
	case len(values):
		verdict = "PASS"
	case 0:
		verdict = "FAIL"
	}
	r.Targets = append(r.Targets, TargetRow{Metric: metric, Target: target, Values: values, Unit: unit, Verdict: verdict, Comments: comments})
}

// evaluate fills Targets from the measurements.
func (r *Results) evaluate() {
	r.Targets = nil
	variants := r.variantNames()
	for _, sh := range r.Ceiling {
		for _, br := range r.Brokers {
			for _, v := range variants {
				var ratios, ackedRatios, cpu, rss []float64
				for rep := 1; rep <= r.Repeat; rep++ {
					recv := sh.ceilingRun(rep)
					rel := sh.run("relay/"+br, v, rep)
					if rel == nil {
						continue
					}
					if recv != nil {
						ratios = append(ratios, rel.EventsPerSec/recv.EventsPerSec)
						if rel.AckedSeconds > 0 {
							ackedRatios = append(ackedRatios, recv.Seconds/rel.AckedSeconds)
						}
					}
					cpu = append(cpu, rel.CPUUsPerEvent)
					rss = append(rss, rel.PeakRSSMB)
				}
				r.target(fmt.Sprintf("throughput ratio relay ÷ pg_recvlogical, %s, %s%s", sh.Shape, br, vsuffix(v)), "≥ 0.95", "", ratios,
					func(v float64) bool { return v >= 0.95 }, "to confirmed end; at all acked: "+joinValues(ackedRatios, "%.2f"))
				r.target(fmt.Sprintf("relay CPU per event catching up, %s, %s%s", sh.Shape, br, vsuffix(v)), "≤ 10 µs", "µs", cpu,
					func(v float64) bool { return v <= 10 }, fmt.Sprintf("= %s CPU s per 100,000 events", joinValues(scale(cpu, 0.1), "%.2f")))
				r.target(fmt.Sprintf("relay peak RSS draining the backlog, %s, %s%s", sh.Shape, br, vsuffix(v)), "≤ 64 MB", "MB", rss,
					func(v float64) bool { return v <= 64 }, "")
			}
		}
	}
	r.evaluateEOSCatchUp(variants)
	if r.BigTxn != nil {
		for _, br := range r.Brokers {
			for _, v := range variants {
				var rss []float64
				for _, run := range r.BigTxn.Runs {
					if run.Reader == "relay/"+br && run.Variant == v {
						rss = append(rss, run.PeakRSSMB)
					}
				}
				r.target(fmt.Sprintf("relay peak RSS, one transaction of %d rows, %s%s", r.BigTxn.Events, br, vsuffix(v)), "≤ 64 MB", "MB", rss,
					func(v float64) bool { return v <= 64 }, "")
			}
		}
	}
	for _, l := range r.Latency {
		var p99 []float64
		for _, ph := range l.Phases {
			if ph.TargetRate == 5000 {
				p99 = append(p99, ph.P99Ms)
			}
		}
		r.target(fmt.Sprintf("p99 commit-to-ack at 5,000 events/s, %s", l.Broker), "≤ 10 ms", "ms", p99,
			func(v float64) bool { return v <= 10 }, "exact, every event recorded (in-process relay)")
	}
	r.evaluateSteady()
	r.evaluateEOS()
	r.inboxTargets()
	r.pollTargets()
	for _, a := range r.Allocs {
		if a.Name == "single-row-txns" || a.Name == "100-row-txns" {
			r.target("allocations per event, decode + build ("+a.Name+")", "≤ 4", "", []float64{a.AllocsPerOp},
				func(v float64) bool { return v <= 4 }, "relay/bench_test.go BenchmarkDecodeAndBuild")
		}
	}
}

func scale(v []float64, f float64) []float64 {
	out := make([]float64, len(v))
	for i := range v {
		out[i] = v[i] * f
	}
	return out
}

// variantNames lists the relay variants measured, "" for the default.
func (r *Results) variantNames() []string {
	seen := map[string]bool{}
	var out []string
	add := func(runs []DrainRun) {
		for _, run := range runs {
			if strings.HasPrefix(run.Reader, "relay/") && !seen[run.Variant] {
				seen[run.Variant] = true
				out = append(out, run.Variant)
			}
		}
	}
	for _, sh := range r.Ceiling {
		add(sh.Runs)
	}
	if r.BigTxn != nil {
		add(r.BigTxn.Runs)
	}
	if len(out) == 0 {
		out = []string{""}
	}
	return out
}

// evaluateEOSCatchUp adds the exactly-once catch-up target: each variant's
// exactly-once drain at least 0.8 of its at-least-once drain in the same
// repetition, with the broker's CPU per event of both.
func (r *Results) evaluateEOSCatchUp(variants []string) {
	for _, sh := range r.Ceiling {
		for _, br := range r.Brokers {
			for _, v := range variants {
				eos := eosVariantName(v)
				if !slices.Contains(variants, eos) {
					continue
				}
				var ratios []float64
				var brokerCost []string
				for rep := 1; rep <= r.Repeat; rep++ {
					alo, txn := sh.run("relay/"+br, v, rep), sh.run("relay/"+br, eos, rep)
					if alo == nil || txn == nil || alo.EventsPerSec == 0 {
						continue
					}
					ratios = append(ratios, txn.EventsPerSec/alo.EventsPerSec)
					brokerCost = append(brokerCost, fmt.Sprintf("%.1f / %.1f", alo.BrokerCPUUsPerEvent, txn.BrokerCPUUsPerEvent))
				}
				r.target(fmt.Sprintf("exactly-once catch-up ÷ at-least-once, %s, %s%s", sh.Shape, br, vsuffix(v)), "≥ 0.8", "", ratios,
					func(v float64) bool { return v >= 0.8 }, "broker CPU µs/event at-least-once / exactly-once: "+strings.Join(brokerCost, ", "))
				var first []float64
				for rep := 1; rep <= r.Repeat; rep++ {
					if txn := sh.run("relay/"+br, eos, rep); txn != nil && txn.FirstVisibleAfter > 0 {
						first = append(first, txn.FirstVisibleAfter)
					}
				}
				r.target(fmt.Sprintf("exactly-once first Kafka commit catching up, after \"streaming\", %s, %s%s", sh.Shape, br, vsuffix(v)), "≤ 0.2 s", "s", first,
					func(v float64) bool { return v <= 0.2 }, "--transaction-interval (default 100 ms) + 100 ms; the topic's last stable offset polled every 10 ms")
			}
		}
	}
}

func vsuffix(v string) string {
	if v == "" {
		return ""
	}
	return " [" + v + "]"
}

// ceilingRun is the faster of a repetition's two pg_recvlogical runs.
func (s *ShapeResult) ceilingRun(rep int) *DrainRun {
	first, after := s.run("pg_recvlogical", "", rep), s.run("pg_recvlogical", "after", rep)
	if first == nil || after != nil && after.EventsPerSec > first.EventsPerSec {
		return after
	}
	return first
}

func (s *ShapeResult) run(reader, variant string, rep int) *DrainRun {
	for i := range s.Runs {
		if s.Runs[i].Reader == reader && s.Runs[i].Variant == variant && s.Runs[i].Rep == rep {
			return &s.Runs[i]
		}
	}
	return nil
}

func joinValues(v []float64, format string) string {
	parts := make([]string, len(v))
	for i, x := range v {
		parts[i] = fmt.Sprintf(format, x)
	}
	return strings.Join(parts, " / ")
}

func valueFormat(unit string, v []float64) string {
	format := "%.2f"
	for _, x := range v {
		if x >= 100 {
			format = "%.0f"
		}
	}
	s := joinValues(v, format)
	if unit != "" {
		s += " " + unit
	}
	return s
}

// markdown renders the results.
func (r *Results) markdown() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w("# outbox-relay benchmark, %s\n\n", r.Timestamp)
	if r.Note != "" {
		w("Note: %s\n\n", r.Note)
	}
	w("`%s` — %d rows per backlog, brokers: %s, %d repetition(s) (values are listed per repetition, `a / b`), took %s.\n\n",
		r.Command, r.Rows, strings.Join(r.Brokers, ", "), r.Repeat, r.Duration)
	w("Machine: %d CPUs (%s), %s, load average at start %s. PostgreSQL fsync=%s, payload %s bytes, %s aggregates, %s partitions per topic, compression %s.\n\n",
		r.Environment.CPUs, r.Environment.CPUModel, r.Environment.GoVersion, r.Environment.LoadAtStart,
		r.Settings["postgres_fsync"], r.Settings["payload_bytes"], r.Settings["aggregates"], r.Settings["partitions"], r.Settings["compression"])
	for _, p := range r.Problems {
		w("**%s**\n\n", p)
	}
	if len(r.Variants) > 0 {
		w("Relay variants, measured side by side on the same backlogs:\n\n")
		for _, v := range r.Variants {
			w("- %s\n", v)
		}
		w("\n")
	}
	w("## Targets\n\n| metric | target | measured | verdict | |\n|---|---|---|---|---|\n")
	for _, t := range r.Targets {
		w("| %s | %s | %s | %s | %s |\n", t.Metric, t.Target, valueFormat(t.Unit, t.Values), t.Verdict, t.Comments)
	}
	if len(r.Ceiling) > 0 {
		w("\n## Ceiling: draining a backlog\n\n")
		w("Each reader has its own slot, created back to back before the backlog was committed. In each repetition pg_recvlogical drains first and again last (\"after\"); the ratio divides by the faster of the two, so the order cannot favour the relay. Time runs from starting the process until pg_recvlogical exits at `--endpos`, or until every event is acknowledged by Kafka and the slot's confirmed_flush_lsn reaches the end position (relay). The relay confirms about 100 ms after its last ack once nothing is in flight; \"ratio at all acked\" uses the time Kafka held every event instead (end offsets polled every 100 ms). Relay CPU is the relay process's CPU clock (nanosecond resolution) from its \"streaming\" log line to the end; walsender CPU is sampled from /proc every 50 ms. Machine busy is all CPUs of the machine, other people's work included.\n\n")
		w("The last columns are the machine's CPU budget: the broker's CPU per event (the JVM; for kfake its own child process), then relay + walsender + broker µs per event, and the events per second two CPUs could sustain at that cost (2,000,000 ÷ the sum), PostgreSQL's other work aside. A ratio below 0.95 with that bound under the pg_recvlogical rate means the box, not the relay's share alone, sets the pace.\n\n")
		w("| shape | reader | rep | seconds | events/s | ratio | all acked at s | ratio at all acked | CPU s | CPU µs/event | CPU s/100k | peak RSS MB | walsender µs/event | broker µs/event | relay+walsender+broker µs/event / events/s two CPUs allow | machine busy |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
		for _, sh := range r.Ceiling {
			runs := sh.Runs
			for _, p := range []*DrainRun{sh.Profile, sh.ProfileEOS} {
				if p != nil {
					runs = append(slices.Clip(runs), *p)
				}
			}
			for _, run := range runs {
				ratio, ackedRatio := "", ""
				if recv := sh.ceilingRun(run.Rep); recv != nil && run.Reader != "pg_recvlogical" {
					ratio = fmt.Sprintf("%.2f", run.EventsPerSec/recv.EventsPerSec)
					if run.AckedSeconds > 0 {
						ackedRatio = fmt.Sprintf("%.2f", recv.Seconds/run.AckedSeconds)
					}
				}
				budget := ""
				if run.BrokerCPUUsPerEvent > 0 {
					total := run.CPUUsPerEvent + run.WalsenderCPUUsPerEvent + run.BrokerCPUUsPerEvent
					budget = fmt.Sprintf("%.2f | %.1f / %.0f", run.BrokerCPUUsPerEvent, total, 2e6/total)
				} else {
					budget = " | "
				}
				w("| %s | %s%s | %d | %.1f | %.0f | %s | %s | %s | %.2f | %.2f | %.2f | %s | %.2f | %s | %.0f%% |\n", sh.Shape, run.label(), nudged(run.Nudged), run.Rep,
					run.Seconds, run.EventsPerSec, ratio, optional(run.AckedSeconds, "%.1f"), ackedRatio, run.CPUSeconds, run.CPUUsPerEvent,
					run.CPUUsPerEvent/10, optional(run.PeakRSSMB, "%.1f"), run.WalsenderCPUUsPerEvent, budget, run.MachineBusyPercent)
			}
		}
		w("\n")
		for _, sh := range r.Ceiling {
			w("- %s: %d events, payload %.0f bytes, committed in %.1f s (%.0f rows/s), %.0f MB of WAL, end %s.\n",
				sh.Shape, sh.Events, sh.PayloadBytes, sh.PrefillSeconds, float64(sh.Events)/sh.PrefillSeconds, float64(sh.WALBytes)/1e6, sh.EndLSN)
			for _, p := range []*DrainRun{sh.Profile, sh.ProfileEOS} {
				if p != nil {
					w("- %s, in-process under pprof, %s: %.1f mallocs and %.0f bytes allocated per event by the whole process (relay and sarama; CPU µs/event counts the whole bench process), peak live heap %.1f MB.\n",
						sh.Shape, orDefault(p.Variant, "at-least-once"), p.MallocsPerEvent, p.AllocBytesPerEvent, p.PeakLiveHeapMB)
				}
			}
		}
	}
	r.eosCatchUpMarkdown(w)
	if r.BigTxn != nil {
		w("\n## One large transaction\n\n%d rows in one transaction (%.0f MB of WAL, committed in %.1f s).\n\n", r.BigTxn.Events,
			float64(r.BigTxn.WALBytes)/1e6, r.BigTxn.PrefillSeconds)
		w("| reader | rep | seconds | events/s | CPU µs/event | peak RSS MB | machine busy |\n|---|---|---|---|---|---|---|\n")
		for _, run := range r.BigTxn.Runs {
			w("| %s%s | %d | %.1f | %.0f | %.2f | %.1f | %.0f%% |\n", run.label(), nudged(run.Nudged), run.Rep, run.Seconds, run.EventsPerSec, run.CPUUsPerEvent, run.PeakRSSMB, run.MachineBusyPercent)
		}
	}
	if len(r.Latency) > 0 {
		w("\n## Live commit-to-ack latency\n\n")
		w("%s. Commit time is the Commit message's timestamp (PostgreSQL's clock), ack time the relay's clock when the producer reported success; same machine, same clock. The first second of each run is warm-up and not counted.\n\n", r.Latency[0].Method)
		w("\"Commit to receive\" is PostgreSQL's share: from the commit to the relay reading the transaction's row (WAL flush, the walsender's decoding, the socket, and waiting for a CPU). What the relay and Kafka add is the difference.\n\n")
		w("| broker | rep | target/s | achieved/s | events | p50 ms | p99 ms | p99.9 ms | max ms | commit to receive p50 / p99 / p99.9 ms | last ack after writers stopped, s | machine busy |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
		for _, l := range r.Latency {
			for _, ph := range l.Phases {
				w("| %s | %d | %s | %.0f | %d | %.2f | %.2f | %.2f | %.1f | %.2f / %.2f / %.2f | %.2f | %.0f%% |\n", l.Broker, ph.Rep, rateName(ph.TargetRate), ph.AchievedRate,
					ph.Measured, ph.P50Ms, ph.P99Ms, ph.P999Ms, ph.MaxMs, ph.ReceiveP50Ms, ph.ReceiveP99Ms, ph.ReceiveP999Ms, ph.DrainSeconds, ph.MachineBusyPercent)
			}
		}
	}
	if len(r.Floor) > 0 {
		w("\n## Producer floor: the publisher alone, no PostgreSQL\n\n")
		w("%s. Open-loop schedule at each rate; the first second is not counted. This is what the producer and the broker add by themselves on this machine; compare it with the live latency above.\n\n", r.Floor[0].Method)
		w("| broker | target/s | achieved/s | records | p50 ms | p99 ms | p99.9 ms | max ms | machine busy |\n|---|---|---|---|---|---|---|---|---|\n")
		for _, l := range r.Floor {
			for _, ph := range l.Phases {
				w("| %s | %s | %.0f | %d | %.2f | %.2f | %.2f | %.1f | %.0f%% |\n", l.Broker, rateName(ph.TargetRate), ph.AchievedRate,
					ph.Measured, ph.P50Ms, ph.P99Ms, ph.P999Ms, ph.MaxMs, ph.MachineBusyPercent)
			}
		}
	}
	r.steadyMarkdown(w)
	r.eosMarkdown(w)
	if len(r.Allocs) > 0 {
		w("\n## Decode and build (`go test -run '^$' -bench DecodeAndBuild -benchmem ./relay/`)\n\n| benchmark | ns/event | B/event | allocs/event |\n|---|---|---|---|\n")
		for _, a := range r.Allocs {
			w("| %s | %.0f | %.0f | %.0f |\n", a.Name, a.NsPerOp, a.BytesPerOp, a.AllocsPerOp)
		}
	}
	r.reconcileMarkdown(w)
	r.writerMarkdown(w)
	r.inboxMarkdown(w)
	r.pollMarkdown(w)
	r.tracingMarkdown(w)
	return b.String()
}

func optional(v float64, format string) string {
	if v == 0 {
		return ""
	}
	return fmt.Sprintf(format, v)
}

// historyLine is the one-line summary appended to history.md.
func (r *Results) historyLine() string {
	get := func(prefix string) string {
		var parts []string
		for _, t := range r.Targets {
			if strings.HasPrefix(t.Metric, prefix) {
				parts = append(parts, joinValues(t.Values, "%.2f"))
			}
		}
		if len(parts) == 0 {
			return "–"
		}
		return strings.Join(parts, "; ")
	}
	maxRSS := 0.0
	for _, t := range r.Targets {
		if strings.Contains(t.Metric, "RSS") {
			for _, v := range t.Values {
				maxRSS = max(maxRSS, v)
			}
		}
	}
	verdicts := map[string]int{}
	for _, t := range r.Targets {
		verdicts[t.Verdict]++
	}
	note := strings.ReplaceAll(r.Note, "|", "/")
	if note == "" {
		note = "–"
	}
	return fmt.Sprintf("| %s | %s | %d×%d | %s | %s | %s | %s | %s | %.1f | %s | %d/%d | %s |\n",
		r.Timestamp, note, r.Rows, r.Repeat, strings.Join(r.Brokers, "+"),
		get("throughput ratio relay ÷ pg_recvlogical, single-row"), get("throughput ratio relay ÷ pg_recvlogical, 100-row"),
		get("relay CPU per event catching up, single-row"), get("p99 commit-to-ack"), maxRSS, get("allocations per event, decode + build (single"),
		verdicts["PASS"], len(r.Targets), r.steadySummary())
}

const historyHeader = `# Benchmark history

One line per ` + "`go run ./test/bench`" + ` run, newest last. Values per broker are separated by ";", repetitions by "/"; each run's timestamped files, in the directory it wrote them to, hold the details.

| when (UTC) | note | rows×repeat | brokers | ratio single-row | ratio 100-row | CPU µs/event single-row | p99 ms @5k/s | max peak RSS MB | allocs/event | targets met | steady 2,000/s: relay CPU µs/event, ÷ pg_recvlogical, p99 ms |
|---|---|---|---|---|---|---|---|---|---|---|---|
`

// write stores latest.{md,json} and timestamped copies in --out, and
// appends the history line to --history or, by default, --out's history.md.
func (b *bench) write() error {
	r := b.res
	r.evaluate()
	dir := b.o.out
	if !filepath.IsAbs(dir) {
		dir = filepath.Join(b.root, dir)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	md := r.markdown()
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	js = append(js, '\n')
	stamp := time.Now().UTC().Format("20060102-150405")
	for name, data := range map[string][]byte{
		"latest.md": []byte(md), "latest.json": js,
		stamp + ".md": []byte(md), stamp + ".json": js,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			return err
		}
	}
	hist := filepath.Join(dir, "history.md")
	if b.o.history != "" {
		hist = b.o.history
		if !filepath.IsAbs(hist) {
			hist = filepath.Join(b.root, hist)
		}
	}
	if err := os.MkdirAll(filepath.Dir(hist), 0o755); err != nil {
		return err
	}
	if _, err := os.Stat(hist); os.IsNotExist(err) {
		if err := os.WriteFile(hist, []byte(historyHeader), 0o644); err != nil {
			return err
		}
	}
	f, err := os.OpenFile(hist, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(r.historyLine()); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	fmt.Println(md)
	b.logf("results written to %s (latest.md, latest.json, %s.md, %s.json); summary line appended to %s", dir, stamp, stamp, hist)
	return nil
}

// eosCatchUpMarkdown sets each repetition's exactly-once drain beside its
// at-least-once twin: rate, ratio, peak RSS, and how soon the first
// position was confirmed and the first record visible to read_committed.
func (r *Results) eosCatchUpMarkdown(w func(string, ...any)) {
	variants := r.variantNames()
	var rows []string
	for _, sh := range r.Ceiling {
		for _, br := range r.Brokers {
			for _, v := range variants {
				eos := eosVariantName(v)
				if !slices.Contains(variants, eos) {
					continue
				}
				for rep := 1; rep <= r.Repeat; rep++ {
					alo, txn := sh.run("relay/"+br, v, rep), sh.run("relay/"+br, eos, rep)
					if alo == nil || txn == nil || alo.EventsPerSec == 0 {
						continue
					}
					rows = append(rows, fmt.Sprintf("| %s | %s | %s | %d | %.0f | %.0f | %.2f | %.1f / %.1f | %s / %s | %s / %s |\n",
						sh.Shape, br, orDefault(v, "default"), rep, alo.EventsPerSec, txn.EventsPerSec, txn.EventsPerSec/alo.EventsPerSec,
						alo.PeakRSSMB, txn.PeakRSSMB, optional(alo.FirstConfirmAfter, "%.3f"), optional(txn.FirstConfirmAfter, "%.3f"),
						optional(alo.FirstVisibleAfter, "%.3f"), optional(txn.FirstVisibleAfter, "%.3f")))
				}
			}
		}
	}
	if len(rows) == 0 {
		return
	}
	w("\n## Exactly-once catch-up beside at-least-once\n\n")
	w("The same drains as above, each repetition's exactly-once run beside its at-least-once twin. Every mode drained once on each broker before the measured repetitions (discarded), and the order of the modes is reversed on even repetitions. First confirm: seconds from the relay's \"streaming\" log line until the slot's confirmed_flush_lsn first moved. First visible: until the topic's last stable offset first moved, that is until a read_committed reader could see a record; exactly-once, that is the first Kafka transaction's commit. Both polled every 10 ms.\n\n")
	w("| shape | broker | variant | rep | at-least-once events/s | exactly-once events/s | ratio | peak RSS MB a-l-o / e-o | first confirm s a-l-o / e-o | first visible s a-l-o / e-o |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for _, row := range rows {
		w("%s", row)
	}
}
