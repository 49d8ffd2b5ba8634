package main

import (
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// systemdNotifier speaks the sd_notify protocol when systemd started the
// process with Type=notify: READY=1 once streaming, WATCHDOG=1 from the
// stream loop's own progress, so a wedged loop gets the process restarted.
// Without NOTIFY_SOCKET every method does nothing.
type systemdNotifier struct {
	log    zerolog.Logger
	socket string
	every  time.Duration // half of WATCHDOG_USEC; zero when no watchdog

	mu        sync.Mutex
	conn      *net.UnixConn
	readySent bool
	nextPing  time.Time
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

// ready is called whenever a session starts streaming; READY=1 goes once.
func (n *systemdNotifier) ready() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.readySent {
		n.readySent = true
		n.send("READY=1\nSTATUS=streaming")
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
	if n.every == 0 {
		return
	}
	n.send("WATCHDOG=1")
	n.nextPing = now.Add(n.every)
}

func (n *systemdNotifier) stopping() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.send("STOPPING=1")
}
