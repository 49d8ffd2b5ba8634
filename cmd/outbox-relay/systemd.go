package main

import (
	"context"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
)

// systemdNotifier speaks the sd_notify protocol when systemd started the
// process with Type=notify. Without NOTIFY_SOCKET every method does nothing.
//
// READY=1 goes once the relay does its job: when a session first streams,
// or when it settles as the standby of another instance that holds the
// slot, or of a PostgreSQL standby it waits to see promoted. A standby is
// a healthy, started service; without READY=1 systemd
// would kill it at TimeoutStartSec and start it again, forever. Until then
// the unit stays "activating" and TimeoutStartSec bounds how long a relay
// that cannot reach PostgreSQL or Kafka at start may take.
//
// WATCHDOG=1 proves that the relay's loops turn, not that the pipeline is
// healthy: restarting the process cannot bring PostgreSQL or Kafka back,
// and a watchdog restart every WatchdogSec during an outage would only add
// SIGABRT goroutine dumps to the journal and hide the real error. Readiness
// (/readyz), STATUS= and the metrics report an outage; the watchdog catches
// a wedge:
//
//   - while streaming, only the stream loop pings (relay.Hooks.Alive), so a
//     stalled stream loop gets the process restarted;
//   - while backing off or waiting for the slot, the restart loop sleeps a
//     bounded time between attempts, so the watcher pings as long as the
//     current state is younger than BackoffMax plus the watchdog period;
//   - while connecting, an attempt that lasts longer than the watchdog
//     period is wedged (a server that accepts TCP and never answers), so
//     the pings stop and systemd restarts the process.
//
// STATUS= carries the state and the last error for `systemctl status`.
// STOPPING=1 goes as soon as shutdown begins, before the drain: systemd
// then stops the watchdog and gives the drain TimeoutStopSec.
type systemdNotifier struct {
	log    zerolog.Logger
	socket string
	every  time.Duration // ping period: half of WATCHDOG_USEC; zero when no watchdog

	mu          sync.Mutex
	conn        *net.UnixConn
	readySent   bool
	stopSent    bool
	nextPing    time.Time
	lastStatus  string
	stopWatcher func() // ends the watcher and waits for it; nil when none runs
}

func newSystemdNotifier(log zerolog.Logger) *systemdNotifier {
	n := &systemdNotifier{log: log, socket: os.Getenv("NOTIFY_SOCKET")}
	if usec, err := strconv.ParseInt(os.Getenv("WATCHDOG_USEC"), 10, 64); err == nil && usec > 0 {
		if pid := os.Getenv("WATCHDOG_PID"); pid == "" || pid == strconv.Itoa(os.Getpid()) {
			n.every = time.Duration(usec) * time.Microsecond / 2
		}
	}
	return n
}

// send writes one notification; the caller holds n.mu.
func (n *systemdNotifier) send(state string) {
	if n.socket == "" {
		return
	}
	if n.conn == nil {
		name := n.socket
		if name[0] == '@' {
			name = "\x00" + name[1:] // abstract socket namespace
		}
		conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: name, Net: "unixgram"})
		if err != nil {
			n.log.Warn().Err(err).Msg("cannot reach systemd's NOTIFY_SOCKET")
			n.socket = ""
			return
		}
		n.conn = conn
	}
	if _, err := n.conn.Write([]byte(state)); err != nil {
		n.log.Warn().Err(err).Str("state", state).Msg("systemd notify failed")
	}
}

// readyAs is called whenever a session starts its work, named state
// (streaming, polling); READY=1 goes once.
func (n *systemdNotifier) readyAs(state pipeline.State) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stopSent {
		return
	}
	if !n.readySent {
		n.readySent = true
		n.lastStatus = "STATUS=" + string(state)
		n.send("READY=1\n" + n.lastStatus)
	}
	n.pingLocked(time.Now())
}

// alive is called from the stream loop; it pings the watchdog at most every
// half watchdog period.
func (n *systemdNotifier) alive() {
	if n.every == 0 {
		return
	}
	now := time.Now()
	n.mu.Lock()
	defer n.mu.Unlock()
	if now.After(n.nextPing) {
		n.pingLocked(now)
	}
}

func (n *systemdNotifier) pingLocked(now time.Time) {
	if n.every == 0 || n.stopSent {
		return
	}
	n.send("WATCHDOG=1")
	n.nextPing = now.Add(n.every)
}

// watch follows the relay's state until ctx ends or stopping is called:
// it sends STATUS= on every change, READY=1 for a standby, watchdog pings
// while the relay is not streaming and its restart loop turns (see the
// type's comment), and STOPPING=1 as soon as ctx ends. Call it once, right
// after creating the relay; stopping waits for it.
func (n *systemdNotifier) watch(ctx context.Context, status func() pipeline.Status, dsn string, backoffMax time.Duration) {
	if n.socket == "" {
		return
	}
	redact := func(s string) string { return pg.RedactError(s, dsn) }
	tick := time.Second
	if n.every > 0 {
		tick = min(tick, n.every/2)
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	var once sync.Once
	n.mu.Lock()
	n.stopWatcher = func() {
		once.Do(func() { close(done) })
		<-finished
	}
	n.mu.Unlock()
	go func() {
		defer close(finished)
		ticker := time.NewTicker(tick)
		defer ticker.Stop()
		for {
			s := status()
			s.LastError = redact(s.LastError)
			n.observe(s, time.Now(), backoffMax)
			select {
			case <-ctx.Done():
				n.beginStopping()
				return
			case <-done:
				return
			case <-ticker.C:
			}
		}
	}()
}

// observe acts on one snapshot of the relay's state.
func (n *systemdNotifier) observe(s pipeline.Status, now time.Time, backoffMax time.Duration) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stopSent {
		return
	}
	var msgs []string
	if text := statusText(s); text != n.lastStatus {
		n.lastStatus = text
		msgs = append(msgs, text)
	}
	if (s.State == pipeline.StateWaitingForSlot || s.State == pipeline.StateWaitingForLock || s.State == pipeline.StateWaitingForPromotion) && !n.readySent {
		n.readySent = true
		msgs = append([]string{"READY=1"}, msgs...)
	}
	if len(msgs) > 0 {
		n.send(strings.Join(msgs, "\n"))
	}
	if n.every > 0 && now.After(n.nextPing) && n.loopTurning(s, now, backoffMax) {
		n.pingLocked(now)
	}
}

// loopTurning reports whether the relay, in a state other than streaming,
// is still within the time that state may last while its loop works.
func (n *systemdNotifier) loopTurning(s pipeline.Status, now time.Time, backoffMax time.Duration) bool {
	watchdog := 2 * n.every // WatchdogSec
	in := now.Sub(s.Since)
	if s.Since.IsZero() {
		in = 0 // the relay has not changed state since it was created
	}
	switch s.State {
	case pipeline.StateBackingOff, pipeline.StateWaitingForSlot, pipeline.StateWaitingForLock, pipeline.StateWaitingForPromotion:
		return in < backoffMax+watchdog
	case pipeline.StateStarting, pipeline.StateConnecting:
		return in < watchdog
	}
	// Streaming: the stream loop pings. Draining, stopped, failed: the
	// process is on its way out and STOPPING=1 turned the watchdog off.
	return false
}

// statusText is the STATUS= line for a state: one line, no longer than
// systemctl status shows comfortably.
func statusText(s pipeline.Status) string {
	text := string(s.State)
	switch s.State {
	case pipeline.StateWaitingForSlot, pipeline.StateWaitingForLock:
		text = "standby: " + text
		fallthrough
	case pipeline.StateBackingOff, pipeline.StateWaitingForPromotion, pipeline.StateFailed:
		if s.LastError != "" {
			text += ": " + s.LastError
		}
	case pipeline.StateRecovering:
		if s.Detail != "" {
			text = s.Detail
		}
	}
	text = strings.Join(strings.Fields(text), " ")
	if len(text) > 200 {
		text = text[:197] + "..."
	}
	return "STATUS=" + text
}

// beginStopping tells systemd the shutdown started, once.
func (n *systemdNotifier) beginStopping() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stopSent {
		return
	}
	n.send("STOPPING=1\nSTATUS=stopping: draining in-flight events")
	n.stopSent = true
}

// stopping ends the watcher, if one runs, and sends STOPPING=1 unless the
// watcher already did when the shutdown began.
func (n *systemdNotifier) stopping() {
	n.mu.Lock()
	stop := n.stopWatcher
	n.stopWatcher = nil
	n.mu.Unlock()
	if stop != nil {
		stop()
	}
	n.beginStopping()
}
