package main

import (
	"strings"
	"testing"
)

// measuredResults is what a reduced-size run of every part reports when
// each part measured what it should.
func measuredResults(rows int) Results {
	drains := func() []DrainRun {
		return []DrainRun{
			{Reader: "pg_recvlogical", Events: rows, EventsPerSec: 1000},
			{Reader: "pg_recvlogical", Variant: "after", Events: rows, EventsPerSec: 1000},
			{Reader: "relay/kfake", Rep: 1, Events: rows, EventsPerSec: 1000, CPUUsPerEvent: 4.2, PeakRSSMB: 19.2, FirstConfirmAfter: 0.05, FirstVisibleAfter: 0.01},
			{Reader: "relay/kfake", Variant: "exactly-once", Rep: 1, Events: rows, EventsPerSec: 900, CPUUsPerEvent: 4.6, PeakRSSMB: 21.0, FirstConfirmAfter: 0.15, FirstVisibleAfter: 0.12},
		}
	}
	phase := []LatencyPhase{{TargetRate: 500, Measured: 1000}}
	steady := func(reader, mode string) SteadyRun {
		return SteadyRun{Reader: reader, Mode: mode, Rate: 500, Events: 1000, CPUUsPerEvent: 50,
			P99Ms: 8, BrokerCPUUsPerEvent: 30, PostgresCPUUsPerEvent: 40}
	}
	r := Results{
		Repeat: 1, Brokers: []string{"kfake"},
		Ceiling: []ShapeResult{{Shape: "single-row", Runs: drains()}, {Shape: "100-row", Runs: drains()}},
		Latency: []LatencyResult{{Broker: "kfake", Phases: phase}},
		Floor:   []LatencyResult{{Broker: "kfake", Phases: phase}},
		Steady: &SteadyResult{Runs: []SteadyRun{steady("pg_recvlogical", ""), steady("floor-sarama/kfake", ""),
			steady("floor-franz-go/kfake", ""), steady("relay/kfake", "")}},
		EOS:       &EOSResult{Runs: []SteadyRun{steady("relay/kfake", "at-least-once"), steady("relay/kfake", "exactly-once")}},
		Reconcile: []ReconcileResult{{Correct: true}},
		Writer: []WriterResult{{Mode: "batch", Events: rows, EventsPerSec: 9000, PerTxn: 100, StatementsTxn: 1},
			{Mode: "single", Events: rows, EventsPerSec: 4000, PerTxn: 100, StatementsTxn: 100}},
	}
	for _, c := range inboxConsumers {
		r.Inbox = append(r.Inbox, InboxResult{Broker: "kfake", Consumer: c.name, Events: rows, Seconds: 1, EventsPerSec: float64(rows), RatioToNaive: 1})
	}
	for _, source := range []string{"wal", sourcePollLease, sourcePollSnapshot} {
		r.Poll = pollResultWith(r.Poll, source, rows)
	}
	for _, source := range []string{"wal", "messages"} {
		r.Messages = pollResultWith(r.Messages, source, rows)
	}
	r.Tracing = &TracingResult{Spans: map[string]int64{"tracing on": 2000, "sampled 1%": 20}}
	for _, setting := range []string{"tracing off", "tracing on", "sampled 1%"} {
		r.Tracing.CatchUp = append(r.Tracing.CatchUp, DrainRun{Reader: "relay/kfake", Variant: setting, Rep: 1, Events: rows, EventsPerSec: 1000, CPUUsPerEvent: 4})
		r.Tracing.Steady = append(r.Tracing.Steady, SteadyRun{Reader: "relay/kfake", Variant: setting, Rep: 1, Rate: 2000, Events: 1000, CPUUsPerEvent: 50})
	}
	r.evaluate()
	return r
}

// pollResultWith adds a fully measured source to the poll part.
func pollResultWith(p *PollResult, source string, rows int) *PollResult {
	if p == nil {
		p = &PollResult{}
	}
	p.Runs = append(p.Runs,
		PollRun{Source: source, Phase: "500/s", Events: 1000, EventsPerSec: 500, P99Ms: 9, RelayCPUUsPerEvent: 40, PostgresCPUUsPerEvent: 60, WALBytesPerEvent: 900},
		PollRun{Source: source, Phase: "catch-up", Events: rows, EventsPerSec: 9000, RelayCPUUsPerEvent: 20, PostgresCPUUsPerEvent: 30, WALBytesPerEvent: 100, FillWALBytesPerEvent: 700})
	state := int64(0)
	if pollStrategies[source] != "" {
		state = 8192
	}
	p.Sizes = append(p.Sizes, PollSize{Source: source, Events: int64(rows) + 1000, OutboxBytes: 1 << 20, StateBytes: state})
	p.Idle = append(p.Idle, PollIdle{Source: source, Seconds: 2, PostgresCPUMsPS: 0.5})
	return p
}

const measuredMarkdown = "\n## Ceiling\n## Exactly-once catch-up beside at-least-once\n## Live commit-to-ack latency\n## Producer floor\n## Steady rate\n## Exactly-once\n## Reconcile\n## Writer\n## Polling or CDC\n## Messages\n## Tracing cost\n"

// A drain of a 1,000-row backlog takes a few milliseconds of relay CPU.
// The bench read it in 10 ms clock ticks, so it often reported 0, and the
// reduced-size test failed by chance. The clock is finer now, but a part
// that reports zero CPU measured nothing, and the check must still fail.
func TestUnmeasuredCPUFailsTheReducedSizeCheck(t *testing.T) {
	const rows = 1000
	if got := unmeasured(measuredResults(rows), rows, measuredMarkdown, "reduced-size check"); len(got) != 0 {
		t.Fatalf("a fully measured run was refused: %q", got)
	}
	for _, c := range []struct {
		name  string
		unset func(*Results)
		want  string
		lines int // how many lines the check reports; 0 means one
	}{
		{"catch-up relay CPU", func(r *Results) { r.Ceiling[1].Runs[2].CPUUsPerEvent = 0 }, "100-row, relay/kfake: CPU 0.0 µs/event", 0},
		{"steady relay CPU", func(r *Results) { r.Steady.Runs[3].CPUUsPerEvent = 0 }, "steady rate, relay/kfake", 0},
		{"steady broker CPU", func(r *Results) { r.Steady.Runs[3].BrokerCPUUsPerEvent = 0 }, "broker 0.0 µs/event", 0},
		{"steady PostgreSQL CPU", func(r *Results) { r.Steady.Runs[3].PostgresCPUUsPerEvent = 0 }, "PostgreSQL 0.0 µs/event", 0},
		{"pg_recvlogical CPU", func(r *Results) { r.Steady.Runs[0].CPUUsPerEvent = 0 }, "steady rate, pg_recvlogical", 0},
		{"poll mode's PostgreSQL CPU", func(r *Results) { r.Poll.Runs[2].PostgresCPUUsPerEvent = 0 }, "poll part, poll at 500/s", 0},
		{"poll part missing", func(r *Results) { r.Poll = nil }, "no poll part", 0},
		{"messages source's WAL", func(r *Results) { r.Messages.Runs[2].WALBytesPerEvent = 0 }, "messages part, messages at 500/s", 0},
		{"messages part missing", func(r *Results) { r.Messages = nil }, "no messages part", 0},
		{"tracing part missing", func(r *Results) { r.Tracing = nil }, "no tracing part", 0},
		{"tracing on, CPU", func(r *Results) { r.Tracing.Steady[1].CPUUsPerEvent = 0 }, "tracing part, tracing on", 0},
		{"no spans exported", func(r *Results) { r.Tracing.Spans["tracing on"] = 0 }, "spans exported", 0},
		{"first confirm", func(r *Results) { r.Ceiling[0].Runs[3].FirstConfirmAfter = 0 }, "single-row, relay/kfake [exactly-once]: first confirm 0.000s", 0},
		{"exactly-once catch-up", func(r *Results) {
			r.Ceiling[0].Runs = r.Ceiling[0].Runs[:3]
			r.evaluate()
		}, "no relay/kfake [exactly-once] drain", 2}, // and the ratio it would have given
	} {
		t.Run(c.name, func(t *testing.T) {
			r := measuredResults(rows)
			c.unset(&r)
			got := unmeasured(r, rows, measuredMarkdown, "reduced-size check")
			if c.lines == 0 {
				c.lines = 1
			}
			if len(got) != c.lines || !strings.Contains(got[0], c.want) {
				t.Fatalf("with %s at zero the check said %q; want %d line(s), the first containing %q", c.name, got, c.lines, c.want)
			}
		})
	}
}
