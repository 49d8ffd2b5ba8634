package main

// The exactly-once part: live latency as a read_committed consumer sees it,
// with at-least-once side by side. (Catch-up throughput and CPU per event
// next to at-least-once come from the drain part with two variants of one
// binary, the second with OUTBOX_RELAY_DELIVERY=exactly-once; see
// README.md.)

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// eosRate is the commit rate the issue sets the latency target at.
const eosRate = 2000

// eosDeliveryEnv switches a relay variant to exactly-once delivery.
const eosDeliveryEnv = "OUTBOX_RELAY_DELIVERY=exactly-once"

// EOSResult is the exactly-once latency part: for each relay variant, a
// steady-rate run in each mode, side by side in each repetition.
type EOSResult struct {
	Method string `json:"method"`
	// IntervalMs is the default --transaction-interval; the target is
	// p99 at most this plus 10 ms.
	IntervalMs float64     `json:"interval_ms"`
	Runs       []SteadyRun `json:"runs"`
}

// eosLatency runs each relay variant at eosRate as a subprocess with its
// default flags, once at-least-once and once with --delivery exactly-once,
// each on a fresh slot and topic read by the steady-rate part's independent
// consumer (franz-go, read_committed).
func (b *bench) eosLatency(ctx context.Context) (*EOSResult, error) {
	interval := relay.DefaultConfig().TransactionInterval
	res := &EOSResult{IntervalMs: float64(interval.Milliseconds()),
		Method: fmt.Sprintf("%s. Each variant runs at %d/s twice per repetition, at-least-once and then exactly-once (default --transaction-interval %s, target p99 ≤ %s); the consumer reads with isolation.level=read_committed",
			steadyMethod, eosRate, interval, interval+10*time.Millisecond)}
	dsn, logDir, done, err := b.liveRelayDB(ctx, "bench_eos")
	if err != nil {
		return nil, err
	}
	defer done()
	pad := b.o.payload - len(payloadJSON(0, 0))
	for rep := 1; rep <= b.o.repeat; rep++ {
		for _, br := range b.brokers {
			for vi, v := range b.o.variants {
				eos := variant{name: v.name, bin: v.bin, env: append(slices.Clone(v.env), eosDeliveryEnv)}
				for i, mode := range []struct {
					v     variant
					label string
				}{{v, "at-least-once"}, {eos, "exactly-once"}} {
					if err := ctx.Err(); err != nil {
						return res, err
					}
					// Slots and topics are named by variant index: the
					// exactly-once runs take indexes after the variants'.
					run, err := b.steadyRelay(ctx, dsn, br, vi+i*len(b.o.variants), mode.v, eosRate, pad, rep, logDir)
					run.Mode = mode.label
					if err != nil {
						return res, fmt.Errorf("%s %s: %w", run.label(), mode.label, err)
					}
					run.Rep = rep
					b.logf("exactly-once part, %s %s #%d at %d/s: read_committed p50 %.1f ms, p99 %.1f ms, p99.9 %.1f ms; CPU %.1f µs/event, broker %.1f µs/event; machine %.0f%% busy",
						run.label(), mode.label, rep, eosRate, run.P50Ms, run.P99Ms, run.P999Ms, run.CPUUsPerEvent, run.BrokerCPUUsPerEvent, run.MachineBusyPercent)
					res.Runs = append(res.Runs, run)
				}
			}
		}
	}
	return res, nil
}

// evaluateEOS adds the exactly-once latency target: p99 at most the
// transaction interval plus 10 ms, against kfake as the steady-rate one.
func (r *Results) evaluateEOS() {
	if r.EOS == nil {
		return
	}
	type key struct{ reader, variant string }
	var order []key
	p99, alo := map[key][]float64{}, map[key][]float64{}
	for _, run := range r.EOS.Runs {
		k := key{run.Reader, run.Variant}
		if run.Mode != "exactly-once" {
			alo[k] = append(alo[k], run.P99Ms)
			continue
		}
		if _, seen := p99[k]; !seen {
			order = append(order, k)
		}
		p99[k] = append(p99[k], run.P99Ms)
	}
	limit := r.EOS.IntervalMs + 10
	for _, k := range order {
		r.target(fmt.Sprintf("exactly-once p99 commit-to-consumer at 2,000/s, %s", readerLabel(k.reader, k.variant)),
			fmt.Sprintf("≤ %.0f ms", limit), "ms", p99[k], func(v float64) bool { return v <= limit },
			"read_committed; at-least-once in the same repetitions: "+joinValues(alo[k], "%.1f")+" ms")
	}
}

// eosMarkdown renders the exactly-once latency part.
func (r *Results) eosMarkdown(w func(string, ...any)) {
	e := r.EOS
	if e == nil || len(e.Runs) == 0 {
		return
	}
	w("\n## Exactly-once: latency and cost at a steady rate, next to at-least-once\n\n%s.\n\n", e.Method)
	w("| reader | mode | rep | achieved/s | events | p50 / p99 / p99.9 / max ms | CPU µs/event | broker µs/event | peak RSS MB | machine busy |\n")
	w("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, run := range e.Runs {
		w("| %s | %s | %d | %.0f | %d | %.1f / %.1f / %.1f / %.1f | %.1f | %.1f | %.1f | %.0f%% |\n",
			run.label(), run.Mode, run.Rep, run.AchievedRate, run.Events, run.P50Ms, run.P99Ms, run.P999Ms, run.MaxMs,
			run.CPUUsPerEvent, run.BrokerCPUUsPerEvent, run.PeakRSSMB, run.MachineBusyPercent)
	}
}
