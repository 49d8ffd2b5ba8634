package main

// The exactly-once part: live latency as a read_committed consumer sees it.
// (Catch-up throughput and CPU per event next to at-least-once come from
// the drain part with two variants of one binary, the second with
// OUTBOX_RELAY_DELIVERY=exactly-once; see README.md.)

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/relay"
)

// eosRate is the commit rate the issue sets the latency target at.
const eosRate = 2000

// eosLatency runs the relay in-process with --delivery exactly-once,
// commits single-row transactions at eosRate, and measures from each row's
// occurred_at (its inserting transaction's now(), a single-row transaction
// commits right after) to a franz-go read_committed consumer reading it.
func (b *bench) eosLatency(ctx context.Context, br *broker) (LatencyResult, error) {
	interval := relay.DefaultConfig().TransactionInterval
	res := LatencyResult{Broker: br.name,
		Method: fmt.Sprintf("exactly-once relay in-process (--transaction-interval %s, target p99 <= %s); occurred_at of single-row transactions to a franz-go read_committed consumer polling the topic, at %d/s", interval, interval+10*time.Millisecond, eosRate)}
	dsn, slot, topic, drop, err := b.liveSetup(ctx, br, "eos")
	if err != nil {
		return res, err
	}
	defer drop()
	p := b.startInProcessWith(dsn, slot, br, topic, stderrWarnings(), func(c *relay.Config) { c.Delivery = relay.DeliveryExactlyOnce })
	defer p.stop()
	if err := p.waitStreaming(ctx); err != nil {
		return res, err
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(br.addrs...), kgo.ConsumeTopics(topic),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.FetchMaxWait(10*time.Millisecond)) // a long-poll wait would add to what is measured
	if err != nil {
		return res, err
	}
	defer cl.Close()
	seen := make(chan time.Duration, 1<<16)
	consumeCtx, stopConsuming := context.WithCancel(ctx)
	defer stopConsuming()
	go func() {
		for consumeCtx.Err() == nil {
			fetches := cl.PollFetches(consumeCtx)
			now := time.Now()
			fetches.EachRecord(func(r *kgo.Record) {
				for _, h := range r.Headers {
					if h.Key != "occurred_at" {
						continue
					}
					if at, err := time.Parse(time.RFC3339Nano, string(h.Value)); err == nil {
						select {
						case seen <- now.Sub(at):
						default:
						}
					}
				}
			})
		}
	}()

	pad := b.o.payload - len(payloadJSON(0, 0))
	for rep := 1; rep <= b.o.repeat; rep++ {
		start, busy := time.Now(), startBusy()
		written, elapsed, err := writeAtRate(ctx, dsn, eosRate, b.o.latencyFor, b.o.writers, b.o.aggregates, pad)
		if err != nil {
			return res, err
		}
		busyPercent := busy.percent()
		var lat []float64
		deadline := time.After(2 * time.Minute)
		for int64(len(lat)) < written {
			select {
			case d := <-seen:
				lat = append(lat, d.Seconds())
			case <-deadline:
				return res, fmt.Errorf("exactly-once latency: %d of %d events visible to read_committed within 2 minutes", len(lat), written)
			}
		}
		// The first second is warm-up: drop the earliest observations.
		warm := min(len(lat), eosRate)
		v := append([]float64(nil), lat[warm:]...)
		sort.Float64s(v)
		ph := LatencyPhase{
			Rep: rep, TargetRate: eosRate, Written: written, Seconds: elapsed.Seconds(),
			AchievedRate: float64(written) / elapsed.Seconds(), Measured: len(v),
			P50Ms: 1000 * percentile(v, 0.50), P99Ms: 1000 * percentile(v, 0.99),
			P999Ms: 1000 * percentile(v, 0.999), MaxMs: 1000 * percentile(v, 1),
			DrainSeconds: time.Since(start.Add(elapsed)).Seconds(), MachineBusyPercent: busyPercent,
		}
		b.logf("exactly-once %s #%d at %d/s: read_committed p50 %.1f ms, p99 %.1f ms (target <= %.0f ms), p99.9 %.1f ms, max %.1f ms (%d events; machine %.0f%% busy)",
			br.name, rep, eosRate, ph.P50Ms, ph.P99Ms, float64((interval + 10*time.Millisecond).Milliseconds()), ph.P999Ms, ph.MaxMs, ph.Measured, ph.MachineBusyPercent)
		res.Phases = append(res.Phases, ph)
	}
	return res, nil
}
