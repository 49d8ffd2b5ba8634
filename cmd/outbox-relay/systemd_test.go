package main

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/relay"
)

// notifySocket listens like systemd's notify socket and returns the
// notifier pointed at it, with the given watchdog interval, and a function
// that returns the next datagram or "" when none arrives within wait.
func notifySocket(t *testing.T, watchdog time.Duration) (*systemdNotifier, func(wait time.Duration) string) {
	t.Helper()
	// Unix socket paths are short (108 bytes); t.TempDir() can be longer.
	dir, err := os.MkdirTemp("", "sd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	n := &systemdNotifier{log: zerolog.Nop(), socket: path, every: watchdog / 2}
	next := func(wait time.Duration) string {
		t.Helper()
		buf := make([]byte, 4096)
		conn.SetReadDeadline(time.Now().Add(wait))
		k, err := conn.Read(buf)
		var nerr net.Error
		if errors.As(err, &nerr) && nerr.Timeout() {
			return ""
		}
		if err != nil {
			t.Fatalf("read notify socket: %v", err)
		}
		return string(buf[:k])
	}
	return n, next
}

// none asserts that nothing more was sent. A datagram is written before the
// call that sends it returns, so a short wait suffices.
func none(t *testing.T, next func(time.Duration) string) {
	t.Helper()
	if msg := next(50 * time.Millisecond); msg != "" {
		t.Fatalf("unexpected notification %q", msg)
	}
}

func TestNotifierReadyOnceThenWatchdogFromStreamLoop(t *testing.T) {
	n, next := notifySocket(t, 2*time.Second)
	n.readyAs(pipeline.StateStreaming)
	if got := next(time.Second); got != "READY=1\nSTATUS=streaming" {
		t.Fatalf("first streaming sent %q, want READY=1 and STATUS", got)
	}
	if got := next(time.Second); got != "WATCHDOG=1" {
		t.Fatalf("after READY got %q, want a watchdog ping", got)
	}
	// A later session streaming again does not repeat READY=1.
	n.nextPing = time.Time{}
	n.readyAs(pipeline.StateStreaming)
	if got := next(time.Second); got != "WATCHDOG=1" {
		t.Fatalf("second streaming sent %q, want only a ping", got)
	}
	// The stream loop's pings are rate-limited to half the period.
	n.alive()
	none(t, next)
	n.nextPing = time.Now().Add(-time.Millisecond)
	n.alive()
	if got := next(time.Second); got != "WATCHDOG=1" {
		t.Fatalf("alive after the period sent %q", got)
	}
}

// The policy of the watcher, state by state (see systemdNotifier).
func TestNotifierWatchdogPolicy(t *testing.T) {
	const watchdog = 2 * time.Second
	const backoffMax = 30 * time.Second
	now := time.Now()
	for _, tc := range []struct {
		state pipeline.State
		age   time.Duration
		ping  bool
	}{
		{pipeline.StateStreaming, 0, false}, // the stream loop pings
		{pipeline.StateStreaming, time.Hour, false},
		{pipeline.StateBackingOff, 0, true},
		{pipeline.StateBackingOff, backoffMax + watchdog - time.Second, true},
		{pipeline.StateBackingOff, backoffMax + watchdog + time.Second, false}, // the sleep cannot last this long
		{pipeline.StateWaitingForSlot, time.Second, true},
		{pipeline.StateWaitingForSlot, 10 * time.Minute, false},
		{pipeline.StateConnecting, time.Second, true},
		{pipeline.StateConnecting, watchdog + time.Millisecond, false}, // a hung connect
		{pipeline.StateStarting, 0, true},
		{pipeline.StateStarting, -1, true}, // zero Since: the relay was just created
		{pipeline.StateDraining, 0, false},
		{pipeline.StateFailed, 0, false},
		{pipeline.StateStopped, 0, false},
	} {
		n := &systemdNotifier{every: watchdog / 2}
		since := now.Add(-tc.age)
		if tc.age < 0 {
			since = time.Time{}
		}
		got := n.loopTurning(pipeline.Status{State: tc.state, Since: since}, now, backoffMax)
		if got != tc.ping {
			t.Errorf("%s for %v: ping=%v, want %v", tc.state, tc.age, got, tc.ping)
		}
	}
}

func TestNotifierStandbyIsReadyAndStatusNamesTheError(t *testing.T) {
	n, next := notifySocket(t, 2*time.Second)
	now := time.Now()
	n.observe(pipeline.Status{State: pipeline.StateConnecting, Since: now}, now, time.Second)
	if got := next(time.Second); got != "STATUS=connecting" {
		t.Fatalf("connecting sent %q", got)
	}
	if got := next(time.Second); got != "WATCHDOG=1" {
		t.Fatalf("connecting within its bound sent %q, want a ping", got)
	}
	busy := pipeline.Status{State: pipeline.StateWaitingForSlot, Since: now,
		LastError: "replication slot in use:\nreplication slot \"s\" is active for PID 42"}
	n.observe(busy, now, time.Second)
	want := "READY=1\nSTATUS=standby: waiting-for-slot: replication slot in use: replication slot \"s\" is active for PID 42"
	if got := next(time.Second); got != want {
		t.Fatalf("standby sent %q, want %q", got, want)
	}
	// Same state again: no repeated READY or STATUS, and the ping waits
	// for its period.
	n.observe(busy, now, time.Second)
	none(t, next)
	n.observe(pipeline.Status{State: pipeline.StateBackingOff, Since: now, LastError: strings.Repeat("x", 500)}, now.Add(2*time.Second), time.Minute)
	got := next(time.Second)
	if !strings.HasPrefix(got, "STATUS=backing-off: xxx") || len(got) > len("STATUS=")+200 {
		t.Fatalf("long error sent %q, want a STATUS line cut to 200 characters", got)
	}
	if got := next(time.Second); got != "WATCHDOG=1" {
		t.Fatalf("backing off sent %q, want a ping", got)
	}
}

func TestNotifierStoppingGoesOutWhenShutdownBegins(t *testing.T) {
	n, next := notifySocket(t, 0)
	ctx, cancel := context.WithCancel(context.Background())
	status := func() pipeline.Status {
		return pipeline.Status{State: pipeline.StateStreaming, Since: time.Now()}
	}
	n.watch(ctx, status, "", time.Minute)
	if got := next(5 * time.Second); got != "STATUS=streaming" {
		t.Fatalf("watcher sent %q first, want the state", got)
	}
	cancel()
	if got := next(5 * time.Second); got != "STOPPING=1\nSTATUS=stopping: draining in-flight events" {
		t.Fatalf("after the shutdown began the watcher sent %q, want STOPPING=1", got)
	}
	n.stopping() // after the drain: waits for the watcher, sends nothing twice
	n.readyAs(pipeline.StateStreaming)
	n.alive()
	none(t, next)
}

func TestNotifierWithoutSocketDoesNothing(t *testing.T) {
	n := &systemdNotifier{log: zerolog.Nop(), every: time.Second}
	n.readyAs(pipeline.StateStreaming)
	n.alive()
	n.watch(context.Background(), func() pipeline.Status { return pipeline.Status{} }, "", time.Minute)
	n.stopping()
	if n.conn != nil || n.stopWatcher != nil {
		t.Fatal("a notifier without NOTIFY_SOCKET opened a connection or started a watcher")
	}
}

func TestNotifierStatusRedactsThePassword(t *testing.T) {
	n, next := notifySocket(t, 0)
	cfg := relay.DefaultConfig()
	cfg.Replication.DSN = "postgres://relay:Sup3rSecret@db.example:5432/app"
	failing := func() pipeline.Status {
		return pipeline.Status{State: pipeline.StateBackingOff, Since: time.Now(),
			LastError: "connect: postgres://relay:Sup3rSecret@db.example:5432/app refused"}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n.watch(ctx, failing, cfg.Replication.DSN, cfg.BackoffMax)
	defer n.stopping()
	got := next(5 * time.Second)
	if !strings.HasPrefix(got, "STATUS=backing-off: connect:") || strings.Contains(got, "Sup3rSecret") {
		t.Fatalf("status %q: want the error without the password", got)
	}
}
