package main

import (
	"fmt"
	"strings"
)

// evaluateSteady adds the steady-rate targets: at 2,000 events/s, relay CPU
// per event at most 1.5 × pg_recvlogical's in the same repetition, and p99
// commit-to-consumer at most 10 ms against kfake.
func (r *Results) evaluateSteady() {
	if r.Steady == nil {
		return
	}
	type key struct{ reader, variant string }
	var order []key
	cpu, ratio, p99 := map[key][]float64{}, map[key][]float64{}, map[key][]float64{}
	for _, run := range r.Steady.Runs {
		if run.Rate != 2000 || !strings.HasPrefix(run.Reader, "relay/") {
			continue
		}
		k := key{run.Reader, run.Variant}
		if _, seen := cpu[k]; !seen {
			order = append(order, k)
		}
		cpu[k] = append(cpu[k], run.CPUUsPerEvent)
		p99[k] = append(p99[k], run.P99Ms)
		if recv := r.Steady.run(2000, "pg_recvlogical", "", run.Rep); recv != nil && recv.CPUUsPerEvent > 0 {
			ratio[k] = append(ratio[k], run.CPUUsPerEvent/recv.CPUUsPerEvent)
		}
	}
	for _, k := range order {
		name := strings.TrimPrefix(k.reader, "relay/") + vsuffix(k.variant)
		r.target("steady 2,000/s: relay CPU per event ÷ pg_recvlogical's, "+name, "≤ 1.5", "", ratio[k],
			func(v float64) bool { return v <= 1.5 }, "relay "+joinValues(cpu[k], "%.0f")+" µs/event")
		if strings.HasSuffix(k.reader, "/kfake") {
			r.target("steady 2,000/s: p99 commit-to-consumer, "+name, "≤ 10 ms", "ms", p99[k],
				func(v float64) bool { return v <= 10 }, "independent franz-go consumer")
		}
	}
}

// steadyMarkdown renders the steady-rate part.
func (r *Results) steadyMarkdown(w func(string, ...any)) {
	s := r.Steady
	if s == nil || len(s.Runs) == 0 {
		return
	}
	w("\n## Steady rate: what each event costs when the relay keeps up\n\n")
	w("%s. PostgreSQL CPU is the walsender plus the writers' backends. Broker CPU is the JVM for Apache Kafka and kfake's own process for kfake, the consumer's fetches included. ", s.Method)
	w("Latency is from the writer's commit returning to the independent consumer reading the record; for the floors, from building the record. ")
	w("\"Receive\" is the relay's own `outbox_relay_commit_to_receive_seconds` over the same span (PostgreSQL's share: commit timestamp to the relay reading the row; p99 interpolated in its buckets), and its share is its mean over the mean commit-to-consumer latency. ")
	w("Harness CPU is the benchmark's own process (the writers' client side and the consumer; for the floors, the consumer only), which shares the two cores. The floors are bare producers in their own process at the same rate and linger: sarama with the relay's producer settings (idempotent, acks=all, one request in flight, lz4), and franz-go with its defaults and the same linger and compression. pg_recvlogical reads the same stream (pgoutput) and writes it to /dev/null.\n\n")
	w("| rate/s | reader | rep | achieved/s | events | CPU µs/event | ×pg_recvlogical | broker µs/event | PostgreSQL µs/event (walsender) | harness µs/event | p50 / p99 / p99.9 / max ms | receive mean / p99 ms, share | relay's commit-to-ack p99 ms | peak RSS MB | writers, p99 late ms | machine busy (steal) |\n")
	w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, run := range s.Runs {
		vs := ""
		if recv := s.run(run.Rate, "pg_recvlogical", "", run.Rep); recv != nil && recv.CPUUsPerEvent > 0 && run.Reader != "pg_recvlogical" {
			vs = fmt.Sprintf("%.1f", run.CPUUsPerEvent/recv.CPUUsPerEvent)
		}
		label := run.label()
		if run.Linger != "" {
			label += " (linger " + run.Linger + ")"
		}
		lat, recv, writers := "", "", ""
		if run.P50Ms > 0 {
			lat = fmt.Sprintf("%.2f / %.2f / %.2f / %.1f", run.P50Ms, run.P99Ms, run.P999Ms, run.MaxMs)
		}
		if run.ReceiveMeanMs > 0 {
			recv = fmt.Sprintf("%.2f / %.1f, %.0f%%", run.ReceiveMeanMs, run.ReceiveP99Ms, 100*run.ReceiveShare)
		}
		if run.Writers > 0 {
			writers = fmt.Sprintf("%d, %.1f", run.Writers, run.WriterLateP99Ms)
			if !run.RateHeld {
				writers = "**rate not held**: " + writers
			}
		}
		pg := ""
		if run.PostgresCPUUsPerEvent > 0 {
			pg = fmt.Sprintf("%.1f (%.1f)", run.PostgresCPUUsPerEvent, run.WalsenderCPUUsPerEvent)
		}
		w("| %d | %s | %d | %.0f | %d | %.1f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.0f%% (%.0f%%) |\n", run.Rate, label, run.Rep, run.AchievedRate, run.Events,
			run.CPUUsPerEvent, vs, optional(run.BrokerCPUUsPerEvent, "%.1f"), pg, optional(run.HarnessCPUUsPerEvent, "%.1f"), lat, recv, optional(run.AckP99Ms, "%.1f"),
			optional(run.PeakRSSMB, "%.1f"), writers, run.MachineBusyPercent, run.StealPercent)
	}
}
