package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/relay"
)

// profileBroker prefers Apache Kafka. Both brokers run in their own
// processes, so the profile holds the relay and the bench's light polling.
func (b *bench) profileBroker() *broker {
	for _, br := range b.brokers {
		if br.name == "apache" {
			return br
		}
	}
	return b.brokers[0]
}

// profileDrain drains the backlog with the relay in-process under the CPU
// profiler (cpu-KEY.pprof), and writes allocation profiles from before and
// after the drain (allocs-before-KEY.pprof, allocs-KEY.pprof: compare them
// with go tool pprof -base) and the heap profile taken when the live heap
// was largest (heap-KEY.pprof). With delivery set, the relay runs in that
// mode.
func (b *bench) profileDrain(ctx context.Context, dsn, slot, key string, br *broker, rows int, end lsn.LSN, delivery string) (DrainRun, error) {
	run := DrainRun{Reader: "relay-in-process/" + br.name + " (pprof)", Variant: delivery, Events: rows}
	dir := b.o.profileDir
	if !filepath.IsAbs(dir) {
		dir = filepath.Join(b.root, dir)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return run, err
	}
	topic := fmt.Sprintf("bench.profile.%s.%d", br.name, time.Now().Unix())
	if err := br.createTopic(topic, b.o.partitions); err != nil {
		return run, err
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return run, err
	}
	defer conn.Close(context.Background())

	write := func(name, profile string) error {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		defer f.Close()
		return pprof.Lookup(profile).WriteTo(f, 0)
	}
	runtime.GC()
	if err := write("allocs-before-"+key+".pprof", "allocs"); err != nil {
		return run, err
	}
	cpuFile, err := os.Create(filepath.Join(dir, "cpu-"+key+".pprof"))
	if err != nil {
		return run, err
	}
	defer cpuFile.Close()

	b.logf("profile: draining %d events with the relay in-process against %s", rows, br.name)
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	cpu0, _ := cpuSeconds(os.Getpid())
	t0, busy := time.Now(), startBusy()
	if err := pprof.StartCPUProfile(cpuFile); err != nil {
		return run, err
	}
	p := b.startInProcess(dsn, slot, br, topic, stderrWarnings(), func(c *relay.Config) {
		if delivery != "" {
			c.Delivery = delivery
		}
	})
	heap := &peakHeap{}
	stopped := false
	defer func() {
		if !stopped {
			pprof.StopCPUProfile()
			p.stop()
		}
	}()
	if err := p.waitStreaming(ctx); err != nil {
		return run, err
	}
	deadline := time.Now().Add(drainTimeout(rows))
	for {
		st, err := readSlot(ctx, conn, slot)
		if err != nil {
			return run, err
		}
		if st.confirmed >= end && p.rec.count() >= rows {
			break
		}
		if time.Now().After(deadline) {
			return run, fmt.Errorf("in-process relay did not drain within %s", drainTimeout(rows))
		}
		if err := heap.sample(); err != nil {
			return run, err
		}
		time.Sleep(50 * time.Millisecond)
	}
	run.Seconds = time.Since(t0).Seconds()
	run.MachineBusyPercent = busy.percent()
	pprof.StopCPUProfile()
	cpu1, _ := cpuSeconds(os.Getpid())
	runtime.ReadMemStats(&ms1)
	stopped = true
	if err := p.stop(); err != nil {
		b.logf("profile: in-process relay stop: %v", err)
	}
	if err := write("allocs-"+key+".pprof", "allocs"); err != nil {
		return run, err
	}
	if err := os.WriteFile(filepath.Join(dir, "heap-"+key+".pprof"), heap.profile, 0o644); err != nil {
		return run, err
	}
	run.PeakLiveHeapMB = float64(heap.live) / (1 << 20)
	run.EventsPerSec = float64(rows) / run.Seconds
	run.CPUSeconds = cpu1 - cpu0
	run.CPUUsPerEvent = run.CPUSeconds * 1e6 / float64(rows)
	run.MallocsPerEvent = float64(ms1.Mallocs-ms0.Mallocs) / float64(rows)
	run.AllocBytesPerEvent = float64(ms1.TotalAlloc-ms0.TotalAlloc) / float64(rows)
	b.logf("profile %s: %.1fs, %.0f events/s, %.2f µs CPU/event (whole bench process), %.1f mallocs/event, %.0f B/event, peak live heap %.1f MB; profiles in %s",
		orDefault(delivery, "at-least-once"), run.Seconds, run.EventsPerSec, run.CPUUsPerEvent, run.MallocsPerEvent, run.AllocBytesPerEvent, run.PeakLiveHeapMB, dir)
	return run, nil
}

// peakHeap keeps the heap profile of the moment the live heap, as the last
// collection found it, was largest.
type peakHeap struct {
	live    uint64
	profile []byte
}

func (h *peakHeap) sample() error {
	m := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(m)
	if m[0].Value.Kind() != metrics.KindUint64 || m[0].Value.Uint64() <= h.live {
		return nil
	}
	var buf bytes.Buffer
	if err := pprof.Lookup("heap").WriteTo(&buf, 0); err != nil {
		return fmt.Errorf("heap profile: %w", err)
	}
	h.live, h.profile = m[0].Value.Uint64(), buf.Bytes()
	return nil
}
