package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
)

// recorder replaces Metrics.CommitToAck (or CommitToReceive) and keeps every
// observation, so percentiles are exact rather than read from histogram
// buckets. The relay observes now − commit time on its outcome goroutine,
// right after the producer reported the record's success (or on its read
// loop, when it decoded the transaction's first row).
type recorder struct {
	mu  sync.Mutex
	obs []observation
}

type observation struct {
	ackNs   int64   // when the relay observed the ack
	latency float64 // seconds from the transaction's commit time
}

func (r *recorder) Observe(v float64) {
	now := time.Now().UnixNano()
	r.mu.Lock()
	r.obs = append(r.obs, observation{now, v})
	r.mu.Unlock()
}

// take returns and forgets the observations so far.
func (r *recorder) take() []observation {
	r.mu.Lock()
	defer r.mu.Unlock()
	o := r.obs
	r.obs = make([]observation, 0, len(o))
	return o
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.obs)
}

// await polls until at least n observations are in, timeout passes or
// abort says to stop, and reports whether n arrived.
func (r *recorder) await(n int, timeout time.Duration, abort func() bool) bool {
	deadline := time.Now().Add(timeout)
	for r.count() < n {
		if !time.Now().Before(deadline) || abort() {
			return false
		}
		time.Sleep(10 * time.Millisecond) // polling the count
	}
	return true
}

// inProcess is a relay.Relay running in the bench process.
type inProcess struct {
	rec       *recorder // commit to ack, per event
	recv      *recorder // commit to the relay reading the first row, per transaction
	cancel    context.CancelFunc
	errc      chan error
	streaming chan struct{}
}

// startInProcess runs relay.New(...).Run with the default configuration on
// slot, publishing to topic, with recorders as Metrics.CommitToAck and
// Metrics.CommitToReceive.
func (b *bench) startInProcess(dsn, slot string, br *broker, topic string, logTo io.Writer, adjust ...func(*relay.Config)) *inProcess {
	cfg := relay.DefaultConfig()
	cfg.Replication.DSN = dsn
	cfg.Replication.Slot = slot
	kafka := publisher.DefaultConfig()
	kafka.Brokers = br.addrs
	kafka.TopicTemplate = topic
	if b.o.compression != "" {
		kafka.Compression = b.o.compression
	}
	if b.o.linger >= 0 {
		kafka.Linger = b.o.linger
	}
	log := zerolog.New(logTo).Level(zerolog.WarnLevel).With().Timestamp().Logger()
	cfg.Sinks = publisher.NewKafka(kafka, log)
	for _, f := range adjust {
		f(&cfg)
	}
	metrics := relay.NewMetrics(nil)
	rec, recv := &recorder{}, &recorder{}
	metrics.CommitToAck, metrics.CommitToReceive = rec, recv
	p := &inProcess{rec: rec, recv: recv, errc: make(chan error, 1), streaming: make(chan struct{})}
	var once sync.Once
	r := relay.New(cfg, log, metrics, relay.Hooks{Running: func() { once.Do(func() { close(p.streaming) }) }})
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	go func() { p.errc <- r.Run(ctx) }()
	return p
}

// waitStreaming waits for the first session to stream.
func (p *inProcess) waitStreaming(ctx context.Context) error {
	select {
	case <-p.streaming:
		return nil
	case err := <-p.errc:
		p.errc <- err
		return fmt.Errorf("relay stopped before streaming: %v", err)
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("relay not streaming after 2 minutes")
	case <-ctx.Done():
		return ctx.Err()
	}
}

// stop cancels the relay and waits for its drain.
func (p *inProcess) stop() error {
	p.cancel()
	select {
	case err := <-p.errc:
		p.errc <- err
		return err
	case <-time.After(60 * time.Second):
		return fmt.Errorf("in-process relay did not stop within 60s")
	}
}

// percentile is the nearest-rank percentile of sorted values.
func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p+0.999999999) - 1
	if i < 0 {
		i = 0
	}
	if i >= len(sorted) {
		i = len(sorted) - 1
	}
	return sorted[i]
}

func sortedLatencies(obs []observation, from, to time.Time) []float64 {
	var v []float64
	for _, o := range obs {
		commit := o.ackNs - int64(o.latency*1e9)
		if commit >= from.UnixNano() && commit <= to.UnixNano() {
			v = append(v, o.latency)
		}
	}
	sort.Float64s(v)
	return v
}

// stderrWarnings sends the in-process relay's warnings to stderr.
func stderrWarnings() io.Writer { return os.Stderr }
