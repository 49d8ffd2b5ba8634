package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// cpuSeconds is the CPU time a process has used so far, in seconds.
func cpuSeconds(pid int) (float64, error) {
	d, err := harness.ProcessCPU(pid)
	return d.Seconds(), err
}

// memKB reads a field such as VmHWM or VmRSS of /proc/<pid>/status, in KiB.
func memKB(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, field+":") {
			f := strings.Fields(line[len(field)+1:])
			if len(f) > 0 {
				return strconv.ParseInt(f[0], 10, 64)
			}
		}
	}
	return 0, fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

// machineCPU returns busy, total and steal jiffies of all CPUs, from
// /proc/stat; busy includes steal.
func machineCPU() (busy, total, steal uint64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, 0, 0
	}
	for i, x := range f[1:] {
		v, _ := strconv.ParseUint(x, 10, 64)
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
		if i == 7 {
			steal = v
		}
	}
	return busy, total, steal
}

// busyMeter measures how busy the whole machine was over an interval, in
// percent of all CPUs: with other work on the machine, numbers measured
// near 100% are not comparable with quiet ones. On a virtual machine part
// of that can be steal: time the host gave the machine's CPUs to others,
// which stretches every wake-up and latency without showing in any
// process's CPU.
type busyMeter struct{ busy, total, steal uint64 }

func startBusy() busyMeter {
	b, t, s := machineCPU()
	return busyMeter{b, t, s}
}

func (m busyMeter) percent() float64 {
	busy, _ := m.percents()
	return busy
}

// percents reads /proc/stat once for how busy the machine was, and the
// share of that the host took as steal, both in percent of all CPUs' time.
func (m busyMeter) percents() (busy, steal float64) {
	b, t, s := machineCPU()
	if t <= m.total {
		return 0, 0
	}
	return 100 * float64(b-m.busy) / float64(t-m.total), 100 * float64(s-m.steal) / float64(t-m.total)
}

// DrainRun is one reader draining a backlog.
type DrainRun struct {
	Reader  string `json:"reader"` // pg_recvlogical, relay/kfake, relay/apache, relay-in-process/...
	Variant string `json:"variant,omitempty"`
	Rep     int    `json:"rep"`
	Events  int    `json:"events"`
	// Seconds runs from starting the process until the end: pg_recvlogical
	// exited at --endpos; the relay had every event acknowledged and the
	// slot's confirmed_flush_lsn at the end position.
	Seconds      float64 `json:"seconds"`
	EventsPerSec float64 `json:"events_per_sec"`
	// AckedSeconds: until Kafka held every event (relay only).
	AckedSeconds float64 `json:"acked_seconds,omitempty"`
	// StreamingAfter: until the relay logged "streaming".
	StreamingAfter float64 `json:"streaming_after_seconds,omitempty"`
	// FirstConfirmAfter: from "streaming" until the slot's
	// confirmed_flush_lsn first moved, polled every 10 ms (relay only).
	FirstConfirmAfter float64 `json:"first_confirm_after_seconds,omitempty"`
	// FirstVisibleAfter: from "streaming" until a read_committed reader
	// could first see a record, the topic's last stable offset polled
	// every 10 ms (relay only). In exactly-once mode that is the first
	// Kafka transaction's commit; at-least-once, the first ack.
	FirstVisibleAfter float64 `json:"first_visible_after_seconds,omitempty"`
	// CPUSeconds is the reader's CPU time from "streaming" to the end
	// (pg_recvlogical: whole run).
	CPUSeconds    float64 `json:"cpu_seconds"`
	CPUUsPerEvent float64 `json:"cpu_us_per_event"`
	PeakRSSMB     float64 `json:"peak_rss_mb,omitempty"`
	// WalsenderCPUUsPerEvent is the walsender's CPU per event, sampled
	// every 50 ms (slightly low for pg_recvlogical, whose walsender exits
	// with it).
	WalsenderCPUUsPerEvent float64 `json:"walsender_cpu_us_per_event"`
	// BrokerCPUUsPerEvent is the broker's CPU per event over the same span
	// as CPUSeconds: the JVM for Apache Kafka, kfake's own child process
	// for kfake.
	BrokerCPUUsPerEvent float64 `json:"broker_cpu_us_per_event,omitempty"`
	// Nudged says the bench had to write WAL after the last ack so that a
	// keepalive let the relay confirm up to the end position.
	Nudged bool `json:"nudged,omitempty"`
	// MallocsPerEvent and AllocBytesPerEvent are the whole process's heap
	// allocations per event (in-process runs only).
	MallocsPerEvent    float64 `json:"mallocs_per_event,omitempty"`
	AllocBytesPerEvent float64 `json:"alloc_bytes_per_event,omitempty"`
	// PeakLiveHeapMB is the largest live heap a collection found during
	// the drain (in-process runs only).
	PeakLiveHeapMB float64 `json:"peak_live_heap_mb,omitempty"`
	// MachineBusyPercent is how busy all CPUs of the machine were during
	// the run, this run and everything else on the machine included.
	MachineBusyPercent float64 `json:"machine_busy_percent"`
}

// label is the reader with its variant, for tables and logs.
func (r *DrainRun) label() string { return readerLabel(r.Reader, r.Variant) }

func readerLabel(reader, variant string) string {
	if variant == "" {
		return reader
	}
	return reader + " [" + variant + "]"
}

// walsenderWatch samples the CPU time of a slot's walsender.
type walsenderWatch struct {
	pid         int
	first, last float64
}

func (w *walsenderWatch) sample(st slotState) {
	if st.activePID == 0 {
		return
	}
	c, err := cpuSeconds(st.activePID)
	if err != nil {
		return
	}
	if w.pid != st.activePID {
		w.pid, w.first = st.activePID, c
	}
	w.last = c
}

func (w *walsenderWatch) used() float64 { return w.last - w.first }

// drainRecvLogical runs pg_recvlogical on slot until the end position.
func (b *bench) drainRecvLogical(ctx context.Context, dsn, slot string, rows int, end lsn.LSN) (DrainRun, error) {
	run := DrainRun{Reader: "pg_recvlogical", Events: rows}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return run, err
	}
	defer conn.Close(context.Background())
	args := []string{"-d", libpqDSN(dsn), "-S", slot, "--start", "--no-loop",
		"-o", "proto_version=1", "-o", "publication_names=" + publication,
		"-E", end.String(), "-f", "/dev/null"}
	cmd := exec.Command(recvlogicalPath(), args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	t0, busy := time.Now(), startBusy()
	if err := cmd.Start(); err != nil {
		return run, fmt.Errorf("start pg_recvlogical: %w", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var ws walsenderWatch
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(drainTimeout(rows))
	for {
		select {
		case err := <-done:
			run.Seconds = time.Since(t0).Seconds()
			run.MachineBusyPercent = busy.percent()
			if err != nil {
				return run, fmt.Errorf("pg_recvlogical: %w: %s", err, out.String())
			}
			run.EventsPerSec = float64(rows) / run.Seconds
			if st := cmd.ProcessState; st != nil {
				run.CPUSeconds = (st.UserTime() + st.SystemTime()).Seconds()
				run.CPUUsPerEvent = run.CPUSeconds * 1e6 / float64(rows)
			}
			run.WalsenderCPUUsPerEvent = ws.used() * 1e6 / float64(rows)
			return run, nil
		case <-tick.C:
			if st, err := readSlot(ctx, conn, slot); err == nil {
				ws.sample(st)
			}
		case <-timeout:
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
			return run, fmt.Errorf("pg_recvlogical did not reach %s within %s: %s", end, drainTimeout(rows), out.String())
		case <-ctx.Done():
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
			return run, ctx.Err()
		}
	}
}

// recvlogicalPath prefers the server's own bin directory's pg_recvlogical.
func recvlogicalPath() string {
	if dir := os.Getenv("OUTBOX_RELAY_PG_BIN"); dir != "" {
		if p := filepath.Join(dir, "pg_recvlogical"); isExec(p) {
			return p
		}
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_recvlogical")
	if len(matches) > 0 {
		return matches[len(matches)-1]
	}
	return "pg_recvlogical"
}

func isExec(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode()&0o111 != 0
}

func drainTimeout(rows int) time.Duration {
	return 5*time.Minute + time.Duration(rows)*time.Millisecond
}

// relayProcess is a relay subprocess with its log.
type relayProcess struct {
	cmd       *exec.Cmd
	done      chan error
	streaming chan struct{}
	// streamingAt is when the "streaming" line was read, set before
	// streaming is closed: the drain loop may notice the close only after
	// its own polling, a hundred milliseconds late on a busy machine.
	streamingAt time.Time
	mu          sync.Mutex
	tail        []string
	stopped     sync.Once
}

func (p *relayProcess) logTail() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.tail, "\n")
}

// startRelay starts `outbox-relay run` on slot, publishing to topic; extra
// flags come last and so win.
func (b *bench) startRelay(dsn, slot string, br *broker, topic string, v variant, logPath string, extra ...string) (*relayProcess, error) {
	args := []string{"run", "--pg-dsn", dsn, "--kafka-brokers", br.list(), "--slot", slot,
		"--topic", topic, "--admin-addr", "", "--log-level", "info"}
	if b.o.compression != "" {
		args = append(args, "--compression", b.o.compression)
	}
	args = append(args, strings.Fields(b.o.extraRelayArg)...)
	args = append(args, extra...)
	cmd := exec.Command(b.binOf(v), args...)
	// The bench's own environment must not configure the relay.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OUTBOX_RELAY_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, v.env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = cmd.Stderr
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	p := &relayProcess{cmd: cmd, done: make(chan error, 1), streaming: make(chan struct{})}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start relay: %w", err)
	}
	var readDone sync.WaitGroup
	readDone.Add(1)
	go func() {
		defer readDone.Done()
		defer logFile.Close()
		sc := bufio.NewScanner(io.TeeReader(stderr, logFile))
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		seen := false
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.tail = append(p.tail, line)
			if len(p.tail) > 30 {
				p.tail = p.tail[1:]
			}
			p.mu.Unlock()
			// Poll mode logs "polling" where the WAL path logs "streaming".
			if !seen && (strings.Contains(line, `"message":"streaming"`) || strings.Contains(line, `"message":"polling"`)) {
				seen = true
				p.streamingAt = time.Now()
				close(p.streaming)
			}
		}
	}()
	go func() {
		readDone.Wait()
		p.done <- cmd.Wait()
	}()
	return p, nil
}

// stop sends SIGTERM, waits for a clean exit, and kills the group after
// 30s. Calls after the first return at once.
func (p *relayProcess) stop() {
	p.stopped.Do(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
	})
}

// drainRelay runs the relay binary on slot until every event is
// acknowledged and the slot's confirmed_flush_lsn reaches end.
func (b *bench) drainRelay(ctx context.Context, dsn, slot string, br *broker, topic string, v variant, rows int, end lsn.LSN, logDir string) (DrainRun, error) {
	run := DrainRun{Reader: "relay/" + br.name, Variant: v.name, Events: rows}
	if err := br.createTopic(topic, b.o.partitions); err != nil {
		return run, err
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return run, err
	}
	defer conn.Close(context.Background())
	// The slot's position before the relay starts: read after, a small
	// backlog may be confirmed already, and its first confirm never seen.
	before, err := readSlot(ctx, conn, slot)
	if err != nil {
		return run, err
	}
	firsts, err := b.watchFirsts(ctx, dsn, slot, br, topic, before.confirmed)
	if err != nil {
		return run, err
	}
	defer firsts.stop()
	t0, busy := time.Now(), startBusy()
	p, err := b.startRelay(dsn, slot, br, topic, v, filepath.Join(logDir, slot+".log"))
	if err != nil {
		return run, err
	}
	defer p.stop()
	pid := p.cmd.Process.Pid

	var ws walsenderWatch
	var cpu0, broker0 float64
	streaming := p.streaming
	var tAcked time.Time
	lastNudge := time.Time{}
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(drainTimeout(rows))
	for n := 0; ; n++ {
		select {
		case <-streaming:
			streaming = nil
			run.StreamingAfter = p.streamingAt.Sub(t0).Seconds()
			cpu0, _ = cpuSeconds(pid)
			broker0 = br.cpuSeconds()
		case err := <-p.done:
			p.done <- err
			return run, fmt.Errorf("relay exited early (%v); log tail:\n%s", err, p.logTail())
		case <-timeout:
			return run, fmt.Errorf("relay did not drain %d events within %s; log tail:\n%s", rows, drainTimeout(rows), p.logTail())
		case <-ctx.Done():
			return run, ctx.Err()
		case <-tick.C:
		}
		if tAcked.IsZero() && n%2 == 0 {
			if acked, err := br.acked(ctx, topic); err == nil && acked >= int64(rows) {
				tAcked = time.Now()
				run.AckedSeconds = tAcked.Sub(t0).Seconds()
			}
		}
		st, err := readSlot(ctx, conn, slot)
		if err != nil {
			return run, err
		}
		ws.sample(st)
		if !tAcked.IsZero() && st.confirmed >= end {
			run.Seconds = time.Since(t0).Seconds()
			if streaming == nil {
				run.FirstConfirmAfter, run.FirstVisibleAfter = firsts.after(p.streamingAt)
			}
			run.MachineBusyPercent = busy.percent()
			cpu1, err := cpuSeconds(pid)
			if err != nil {
				return run, err
			}
			hwm, err := memKB(pid, "VmHWM")
			if err != nil {
				return run, err
			}
			run.EventsPerSec = float64(rows) / run.Seconds
			run.CPUSeconds = cpu1 - cpu0
			run.CPUUsPerEvent = run.CPUSeconds * 1e6 / float64(rows)
			run.PeakRSSMB = float64(hwm) / 1024
			run.WalsenderCPUUsPerEvent = ws.used() * 1e6 / float64(rows)
			run.BrokerCPUUsPerEvent = (br.cpuSeconds() - broker0) * 1e6 / float64(rows)
			return run, nil
		}
		// Everything is acknowledged but the slot waits for a keepalive
		// beyond the end (the last commit ended on a page boundary, or the
		// keepalive came while acks were pending): write WAL to make one.
		if !tAcked.IsZero() && time.Since(tAcked) > 3*time.Second && time.Since(lastNudge) > 3*time.Second {
			if err := nudgeWAL(ctx, conn); err != nil {
				return run, err
			}
			run.Nudged = true
			lastNudge = time.Now()
		}
	}
}

// firstsWatch polls, every 10 ms and apart from the drain's own 50 ms
// loop, for the two moments a consumer of the relay cares about first: the
// slot's confirmed position moving, and a read_committed reader seeing a
// record. Each is polled on a goroutine of its own, and stops once seen.
type firstsWatch struct {
	cancel  context.CancelFunc
	done    sync.WaitGroup
	confirm time.Time // written by its goroutine until done
	visible time.Time
}

// watchFirsts connects to PostgreSQL and asks Kafka once before it
// returns, so that the relay started after it is timed by polls on warm
// connections. Started after the relay, with both polls in one loop, the
// watch's own connection and the first request for the topic's metadata
// took up to 0.2 s and showed as the relay's: the relay's log had its
// first confirm 31 ms after "streaming" when the watch saw it after 182.
func (b *bench) watchFirsts(ctx context.Context, dsn, slot string, br *broker, topic string, start lsn.LSN) (*firstsWatch, error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	if _, err := readSlot(ctx, conn, slot); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	if _, err := br.committed(ctx, topic); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	w := &firstsWatch{cancel: cancel}
	poll := func(seen *time.Time, check func() bool) {
		defer w.done.Done()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for !check() {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
		*seen = time.Now()
	}
	w.done.Add(2)
	go func() {
		defer conn.Close(context.Background())
		poll(&w.confirm, func() bool {
			st, err := readSlot(ctx, conn, slot)
			return err == nil && st.confirmed > start
		})
	}()
	go poll(&w.visible, func() bool {
		n, err := br.committed(ctx, topic)
		return err == nil && n > 0
	})
	return w, nil
}

func (w *firstsWatch) stop() {
	w.cancel()
	w.done.Wait()
}

// after stops the watch and returns how long after from each first came,
// in seconds; 0 for one not seen. A small backlog can be drained between
// two of the watch's polls, so it first gives the watch up to a second to
// see what has happened by now: both only ever move forward.
func (w *firstsWatch) after(from time.Time) (confirm, visible float64) {
	seen := make(chan struct{})
	go func() {
		w.done.Wait()
		close(seen)
	}()
	select {
	case <-seen:
	case <-time.After(time.Second):
	}
	w.stop()
	since := func(t time.Time) float64 {
		if t.IsZero() {
			return 0
		}
		return max(t.Sub(from).Seconds(), 1e-3)
	}
	return since(w.confirm), since(w.visible)
}
