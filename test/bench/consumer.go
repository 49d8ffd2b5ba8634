package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// arrival is one record read by the independent consumer: the value of the
// header it was asked for and when the record reached it.
type arrival struct {
	key string
	at  time.Time
}

// arrivals is an independent franz-go consumer of one topic, from its
// beginning. It never shares code with the relay's sarama producer, so
// what it counts is what Kafka holds.
type arrivals struct {
	cl     *kgo.Client
	header string
	cancel context.CancelFunc
	done   chan struct{}
	closed sync.Once

	mu  sync.Mutex
	got []arrival
}

// consumeArrivals starts reading topic and noting the given header of every
// record. The fetch wait is short so a quiet topic does not delay a record
// that arrives just after a fetch was answered.
func consumeArrivals(br *broker, topic, header string) (*arrivals, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(br.addrs...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond),
		// Records of an exactly-once relay count once committed, as its
		// consumers see them; it changes nothing for at-least-once ones.
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ClientID("bench-consumer"))
	if err != nil {
		return nil, fmt.Errorf("consumer: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	a := &arrivals{cl: cl, header: header, cancel: cancel, done: make(chan struct{})}
	go a.run(ctx)
	return a, nil
}

func (a *arrivals) run(ctx context.Context) {
	defer close(a.done)
	for {
		fetches := a.cl.PollFetches(ctx)
		now := time.Now()
		if ctx.Err() != nil {
			return
		}
		a.mu.Lock()
		fetches.EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == a.header {
					a.got = append(a.got, arrival{key: string(h.Value), at: now})
					break
				}
			}
		})
		a.mu.Unlock()
	}
}

func (a *arrivals) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.got)
}

// await polls until n records arrived or timeout passed, and reports
// whether they did.
func (a *arrivals) await(n int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for a.count() < n {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond) // polling the count
	}
	return true
}

// stop ends the consumer and returns every arrival; it may be called again.
func (a *arrivals) stop() []arrival {
	a.closed.Do(func() {
		a.cancel()
		<-a.done
		a.cl.Close()
	})
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.got
}

// arrivedSince returns the arrivals after the first n.
func (a *arrivals) arrivedSince(n int) []arrival {
	a.mu.Lock()
	defer a.mu.Unlock()
	if n >= len(a.got) {
		return nil
	}
	return append([]arrival(nil), a.got[n:]...)
}
