package publisher

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// ackCounter counts acks and failures.
type ackCounter struct{ acked, failed atomic.Int64 }

// count takes outcomes until they are closed.
func (a *ackCounter) count(outcomes <-chan sink.Outcome) {
	for o := range outcomes {
		if o.Err != nil {
			a.failed.Add(1)
		} else {
			a.acked.Add(1)
		}
	}
}

// benchEvents builds n events of ~300-byte payloads over 1,000 aggregates.
func benchEvents(topic string, n int) []*event.Event {
	payload := make([]byte, 300)
	for i := range payload {
		payload[i] = 'x'
	}
	evs := make([]*event.Event, n)
	for i := range evs {
		evs[i] = &event.Event{
			EventID: []byte(fmt.Sprintf("%s-%09d", topic, i)), AggregateType: []byte(topic),
			AggregateID: []byte("agg-" + strconv.Itoa(i%1000)), EventType: []byte("Happened"),
			SchemaVersion: []byte("1"), Payload: payload, OccurredAt: []byte("2026-12-01 03:00:00+00"),
			Txn: uint64(i/3 + 1),
		}
	}
	return evs
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func benchConfig(brokers []string) Config {
	cfg := DefaultConfig()
	cfg.Brokers = brokers
	cfg.TopicTemplate = "{aggregate_type}"
	return cfg
}

// BenchmarkCatchUp drains a backlog of b.N events (source transactions of
// three) through the at-least-once publisher and through the exactly-once
// sink against kfake, reporting events per second and CPU per event. kfake
// runs in this process, so the CPU includes the broker's share, the same in
// both modes.
//
//	go test -run '^$' -bench BenchmarkCatchUp -benchtime 100000x ./publisher/
func BenchmarkCatchUp(b *testing.B) {
	for _, mode := range []string{"at-least-once", "exactly-once/interval=10ms", "exactly-once/interval=50ms", "exactly-once/interval=100ms"} {
		b.Run(mode, func(b *testing.B) {
			k := harness.StartKfake(b)
			topic := "bench_catch_up"
			k.CreateTopic(b, topic, 10, nil)
			evs := benchEvents(topic, b.N)
			acks := &ackCounter{}
			ctx := context.Background()
			var send func(i int) error
			var finish func() error
			if mode == "at-least-once" {
				p, err := New(benchConfig(k.Brokers()), zerolog.Nop())
				if err != nil {
					b.Fatal(err)
				}
				defer p.Close(10 * time.Second)
				go acks.count(p.Outcomes())
				if _, err := p.BuildWait(ctx, evs[0]); err != nil { // topic discovery, outside the measurement
					b.Fatal(err)
				}
				send = func(i int) error {
					r, err := p.Build(evs[i])
					if err != nil {
						return err
					}
					return p.Send(ctx, r)
				}
				finish = func() error { return nil }
			} else {
				tcfg := DefaultTxnConfig()
				tcfg.TransactionalID = "bench"
				interval, err := time.ParseDuration(mode[len("exactly-once/interval="):])
				if err != nil {
					b.Fatal(err)
				}
				tcfg.Interval = interval
				s, err := NewTxnSink(benchConfig(k.Brokers()), tcfg, zerolog.Nop())
				if err != nil {
					b.Fatal(err)
				}
				d := drive(b, s)
				defer func() { b.ReportMetric(float64(d.stats().committed), "txns") }()
				if _, err := d.build(ctx, evs[0]); err != nil { // topic discovery, outside the measurement
					b.Fatal(err)
				}
				send = func(i int) error {
					r, err := d.build(ctx, evs[i])
					if err != nil {
						return err
					}
					if err := d.send(ctx, r); err != nil {
						return err
					}
					if i%3 == 2 || i == len(evs)-1 {
						return d.put(ctx, sink.Item{End: &sink.SourceEnd{Txn: lsn.TxnID(i/3 + 1), End: lsn.LSN(i + 1), CommitTime: time.Now()}})
					}
					return nil
				}
				finish = func() error {
					err := d.settle(ctx)
					acked, failed := d.counts()
					acks.acked.Add(int64(acked))
					acks.failed.Add(int64(failed))
					return err
				}
			}
			b.ResetTimer()
			began, cpu0 := time.Now(), cpuTime()
			for i := range evs {
				if err := send(i); err != nil {
					b.Fatal(err)
				}
			}
			if err := finish(); err != nil {
				b.Fatal(err)
			}
			for acks.acked.Load()+acks.failed.Load() < int64(len(evs)) {
				time.Sleep(time.Millisecond) // polling the ack count, bounded by b's timeout
			}
			elapsed, cpu := time.Since(began), cpuTime()-cpu0
			b.StopTimer()
			if f := acks.failed.Load(); f != 0 {
				b.Fatalf("%d events failed", f)
			}
			b.ReportMetric(float64(len(evs))/elapsed.Seconds(), "events/s")
			b.ReportMetric(float64(cpu.Microseconds())/float64(len(evs)), "cpu-µs/event")
		})
	}
}

// BenchmarkReadCommittedLatency sends 2,000 events/s for 5 s (source
// transactions of one or two events) through the exactly-once sink with
// several transaction intervals, and measures with a read_committed
// franz-go consumer the time from Send to visible: the relay's share of
// commit-to-consumer latency.
//
//	go test -run '^$' -bench BenchmarkReadCommittedLatency -benchtime 1x ./publisher/
func BenchmarkReadCommittedLatency(b *testing.B) {
	const rate, duration = 2000, 5 * time.Second
	for _, interval := range []time.Duration{10 * time.Millisecond, 20 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond} {
		b.Run("interval="+interval.String(), func(b *testing.B) {
			k := harness.StartKfake(b)
			topic := "latency"
			k.CreateTopic(b, topic, 10, nil)
			tcfg := DefaultTxnConfig()
			tcfg.TransactionalID = "latency"
			tcfg.Interval = interval
			s, err := NewTxnSink(benchConfig(k.Brokers()), tcfg, zerolog.Nop())
			if err != nil {
				b.Fatal(err)
			}
			d := drive(b, s)

			total := int(rate * duration / time.Second)
			latencies := make(chan time.Duration, total)
			cl := harness.NewKgoClient(b, k.Brokers(), kgo.ConsumeTopics(topic),
				kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
				kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.FetchMaxWait(10*time.Millisecond))
			ctx, cancel := context.WithTimeout(context.Background(), duration+30*time.Second)
			defer cancel()
			consumed := make(chan struct{})
			go func() {
				defer close(consumed)
				for n := 0; n < total && ctx.Err() == nil; {
					cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
						sent := time.Unix(0, int64(binary.BigEndian.Uint64(r.Value)))
						latencies <- time.Since(sent)
						n++
					})
				}
			}()

			b.ResetTimer()
			began := time.Now()
			for i := 0; i < total; {
				// Pace to the rate: send what is due, then yield a moment.
				due := min(total, int(time.Since(began)*rate/time.Second))
				for ; i < due; i++ {
					var v [8]byte
					binary.BigEndian.PutUint64(v[:], uint64(time.Now().UnixNano()))
					ev := &event.Event{
						EventID: []byte("lat-" + strconv.Itoa(i)), AggregateType: []byte(topic),
						AggregateID: []byte("agg-" + strconv.Itoa(i%100)), EventType: []byte("Happened"),
						SchemaVersion: []byte("1"), Payload: v[:], OccurredAt: []byte("2026-12-01 03:00:00+00"),
					}
					r, err := d.build(ctx, ev)
					if err != nil {
						b.Fatal(err)
					}
					if err := d.send(ctx, r); err != nil {
						b.Fatal(err)
					}
					if i%3 != 0 {
						if err := d.put(ctx, sink.Item{End: &sink.SourceEnd{Txn: lsn.TxnID(i), End: lsn.LSN(i), CommitTime: time.Now()}}); err != nil {
							b.Fatal(err)
						}
					}
				}
				time.Sleep(time.Millisecond) // pacing, not synchronisation
			}
			if err := d.put(ctx, sink.Item{End: &sink.SourceEnd{Txn: lsn.TxnID(total), End: lsn.LSN(total), CommitTime: time.Now()}}); err != nil {
				b.Fatal(err)
			}
			<-consumed
			b.StopTimer()
			close(latencies)
			all := make([]time.Duration, 0, total)
			for l := range latencies {
				all = append(all, l)
			}
			if len(all) != total {
				b.Fatalf("consumed %d of %d events", len(all), total)
			}
			slices.Sort(all)
			pct := func(p float64) float64 { return float64(all[int(p*float64(len(all)-1))].Microseconds()) / 1000 }
			b.ReportMetric(pct(0.50), "p50-ms")
			b.ReportMetric(pct(0.99), "p99-ms")
			b.ReportMetric(float64(d.stats().committed)/duration.Seconds(), "txns/s")
		})
	}
}
