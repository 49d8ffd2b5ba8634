package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/sink"
)

// floorHandler records each ack's latency from the moment its record was
// built, and the first failure.
type floorHandler struct {
	rec  *recorder
	mu   sync.Mutex
	fail error
}

func (h *floorHandler) Acked(d sink.Delivery) {
	h.rec.Observe(d.At.Sub(d.CommitTime).Seconds())
}

func (h *floorHandler) Failed(_ sink.Delivery, err *sink.Error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.fail == nil {
		h.fail = err
	}
}

func (h *floorHandler) err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.fail
}

// producerFloor measures the relay's publisher alone, with its default
// configuration and nothing of PostgreSQL: events like the latency part's
// are built and sent on an open-loop schedule at each rate, and latency runs
// from building the record to its ack. It is the part of commit-to-ack that
// the producer and the broker set on this machine when nothing else runs.
func (b *bench) producerFloor(ctx context.Context, br *broker) (LatencyResult, error) {
	res := LatencyResult{Broker: br.name,
		Method: "the relay's publisher alone (publisher.New with the relay's default config), no PostgreSQL; latency from building the record to its ack"}
	topic := fmt.Sprintf("bench.floor.%s.%d", br.name, time.Now().Unix())
	if err := br.createTopic(topic, b.o.partitions); err != nil {
		return res, err
	}
	cfg := publisher.DefaultConfig()
	cfg.Brokers = br.addrs
	cfg.TopicTemplate = topic
	if b.o.compression != "" {
		cfg.Compression = b.o.compression
	}
	if b.o.linger >= 0 {
		cfg.Linger = b.o.linger
	}
	h := &floorHandler{rec: &recorder{}}
	pub, err := publisher.New(cfg, zerolog.Nop())
	if err != nil {
		return res, err
	}
	defer pub.Close(10 * time.Second)
	go func() {
		// Ends when Close closes Outcomes.
		for o := range pub.Outcomes() {
			if o.Err != nil {
				h.Failed(o.Delivery, o.Err)
			} else {
				h.Acked(o.Delivery)
			}
		}
	}()

	pad := b.o.payload - len(payloadJSON(0, 0))
	seq := 0
	send := func(rate int, d time.Duration) (int, time.Duration, error) {
		start := time.Now()
		n := 0
		for k := 0; ; k++ {
			due := start.Add(time.Duration(float64(k) * float64(time.Second) / float64(rate)))
			if time.Since(start) >= d || !due.Before(start.Add(d)) {
				return n, time.Since(start), nil
			}
			if wait := time.Until(due); wait > 0 {
				time.Sleep(wait) // pacing the open-loop schedule
			}
			seq++
			ev := &event.Event{
				EventID:       []byte(fmt.Sprintf("floor-%012d", seq)),
				AggregateType: []byte("order"),
				AggregateID:   []byte(fmt.Sprintf("agg-%d", seq%b.o.aggregates)),
				EventType:     []byte("order.updated"),
				SchemaVersion: []byte("1"),
				Payload:       []byte(payloadJSON(seq, pad)),
				OccurredAt:    []byte("2026-11-29 21:03:56.123456+00"),
				Txn:           uint64(seq),
				CommitTime:    time.Now(),
			}
			r, err := pub.BuildWait(ctx, ev)
			if err != nil {
				return n, 0, err
			}
			if err := pub.Send(ctx, r); err != nil {
				return n, 0, err
			}
			n++
		}
	}
	failed := func() bool { return h.err() != nil }
	// Warm up: topic lookup, connections, the broker's JIT. Its acks are
	// awaited and dropped, so none is counted in the first rate.
	warm, _, err := send(500, 2*time.Second)
	if err != nil {
		return res, err
	}
	if !h.rec.await(warm, time.Minute, failed) {
		if err := h.err(); err != nil {
			return res, err
		}
		return res, fmt.Errorf("floor warm-up: %d of %d records acknowledged within a minute", h.rec.count(), warm)
	}
	rates, _ := b.o.rateList()
	for _, rate := range rates {
		if rate == 0 {
			continue // "max" belongs to the database-bound part
		}
		h.rec.take()
		start, busy := time.Now(), startBusy()
		n, elapsed, err := send(rate, b.o.latencyFor)
		if err != nil {
			return res, err
		}
		end := time.Now()
		busyPercent := busy.percent()
		h.rec.await(n, time.Minute, failed)
		if err := h.err(); err != nil {
			return res, err
		}
		obs := h.rec.take()
		if len(obs) < n {
			return res, fmt.Errorf("floor at %d/s: %d of %d records acknowledged within a minute", rate, len(obs), n)
		}
		v := sortedLatencies(obs, start.Add(time.Second), end)
		ph := LatencyPhase{Rep: 1, TargetRate: rate, Written: int64(n), Seconds: elapsed.Seconds(),
			AchievedRate: float64(n) / elapsed.Seconds(), Measured: len(v),
			P50Ms: 1000 * percentile(v, 0.50), P99Ms: 1000 * percentile(v, 0.99),
			P999Ms: 1000 * percentile(v, 0.999), MaxMs: 1000 * percentile(v, 1),
			MachineBusyPercent: busyPercent}
		b.logf("producer floor %s at %d/s: p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms (%d records; machine %.0f%% busy)",
			br.name, rate, ph.P50Ms, ph.P99Ms, ph.P999Ms, ph.Measured, ph.MachineBusyPercent)
		res.Phases = append(res.Phases, ph)
	}
	return res, nil
}
