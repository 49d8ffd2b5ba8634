package ops

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// notification is one sd_notify datagram as systemd would receive it.
type notification struct {
	at    time.Time
	lines []string
}

// notifySocket plays systemd's side of sd_notify: a unixgram socket that
// records every datagram with its arrival time.
type notifySocket struct {
	path string
	conn *net.UnixConn
	done chan struct{}

	mu   sync.Mutex
	msgs []notification
}

func listenNotify(t *testing.T) *notifySocket {
	t.Helper()
	// Socket paths are limited to 108 bytes; t.TempDir() may be longer.
	dir, err := os.MkdirTemp("", "notify")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	n := &notifySocket{path: filepath.Join(dir, "sock"), done: make(chan struct{})}
	n.conn, err = net.ListenUnixgram("unixgram", &net.UnixAddr{Name: n.path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(n.done)
		buf := make([]byte, 4096)
		for {
			k, err := n.conn.Read(buf)
			if err != nil {
				return // closed by the cleanup
			}
			msg := notification{at: time.Now(), lines: strings.Split(string(buf[:k]), "\n")}
			n.mu.Lock()
			n.msgs = append(n.msgs, msg)
			n.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		n.conn.Close()
		<-n.done
	})
	return n
}

// readAll returns once every datagram sent before the call has been
// recorded: it sends a marker of its own and waits for the reader to
// record it, since a unixgram socket keeps its datagrams in order. A test
// calls it after the relay exited, before it counts what was sent.
func (n *notifySocket) readAll(t *testing.T) {
	t.Helper()
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: n.path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	marker := fmt.Sprintf("TEST_MARKER=%d", time.Now().UnixNano())
	if _, err := c.Write([]byte(marker)); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 30*time.Second, "the notify socket's reader to catch up", func() bool { return n.count(marker) == 1 })
}

// env is what the relay needs to talk to this socket with a watchdog.
func (n *notifySocket) env(watchdog time.Duration) []string {
	return []string{"NOTIFY_SOCKET=" + n.path,
		fmt.Sprintf("WATCHDOG_USEC=%d", watchdog.Microseconds()), "WATCHDOG_PID="}
}

// times returns when each line equal to (or, ending in '*', starting
// with) pattern arrived.
func (n *notifySocket) times(pattern string) []time.Time {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []time.Time
	for _, m := range n.msgs {
		for _, l := range m.lines {
			if l == pattern || strings.HasSuffix(pattern, "*") && strings.HasPrefix(l, strings.TrimSuffix(pattern, "*")) {
				out = append(out, m.at)
			}
		}
	}
	return out
}

func (n *notifySocket) count(pattern string) int { return len(n.times(pattern)) }

// lines is every line received, for failure messages.
func (n *notifySocket) lines() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var b strings.Builder
	for _, m := range n.msgs {
		fmt.Fprintf(&b, "%s %q\n", m.at.Format("15:04:05.000"), strings.Join(m.lines, `\n`))
	}
	return b.String()
}

// checkPingsSince waits for five watchdog pings after since, then checks
// that none of the gaps between the pings since then, and since the last
// one, reaches the watchdog period: systemd would restart the process.
func (n *notifySocket) checkPingsSince(t *testing.T, since time.Time, while string, watchdog time.Duration) {
	t.Helper()
	pings := func() []time.Time {
		var out []time.Time
		for _, at := range n.times("WATCHDOG=1") {
			if !at.Before(since) {
				out = append(out, at)
			}
		}
		return out
	}
	harness.WaitFor(t, time.Minute, "five watchdog pings while "+while, func() bool { return len(pings()) >= 5 })
	if gap := maxGap(pings(), time.Now()); gap >= watchdog {
		t.Errorf("a %v gap between watchdog pings while %s (WatchdogSec=%v):\n%s", gap, while, watchdog, n.lines())
	}
}

// maxGap is the longest time between consecutive times, and between the
// last one and until.
func maxGap(times []time.Time, until time.Time) time.Duration {
	var gap time.Duration
	for i := 1; i < len(times); i++ {
		gap = max(gap, times[i].Sub(times[i-1]))
	}
	if len(times) > 0 {
		gap = max(gap, until.Sub(times[len(times)-1]))
	}
	return gap
}

// The sd_notify life of a relay under Type=notify with WatchdogSec=2s:
// no READY=1 while it cannot reach PostgreSQL, but watchdog pings as long
// as its restart loop turns (a restart would not bring PostgreSQL back);
// READY=1 once it streams, and only then; WATCHDOG=1 at least every
// WatchdogSec while streaming; STOPPING=1 as soon as SIGTERM arrives.
func TestNotifyReadyWatchdogAndStopping(t *testing.T) {
	t.Parallel()
	// Pings go every half period; 2s leaves a busy CI machine a second of
	// scheduling slack before a gap counts as a missed ping.
	const watchdog = 2 * time.Second
	e := newEnv(t)
	e.Migrate()
	proxy := harness.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", cluster.Port()))
	proxy.Pause() // PostgreSQL unreachable at start
	dsn := strings.Replace(e.DB.DSN(), fmt.Sprintf(":%d/", cluster.Port()), fmt.Sprintf(":%d/", proxy.Port()), 1)
	sock := listenNotify(t)
	// The stream loop pings at least once per --status-interval; keep that
	// well inside WatchdogSec, as the unit file says.
	p := e.start(e.argsAs(dsn, "run", "--status-interval", "250ms"), sock.env(watchdog)...)
	base := p.AdminURL(t)

	harness.WaitFor(t, time.Minute, "three failed connection attempts and three watchdog pings", func() bool {
		return harness.Metric(t, base, "outbox_relay_stream_restarts_total") >= 3 && sock.count("WATCHDOG=1") >= 3
	})
	if n := sock.count("READY=1"); n != 0 {
		t.Fatalf("READY=1 sent while the relay could not reach PostgreSQL:\n%s", sock.lines())
	}
	if n := sock.count("STATUS=backing-off: *"); n == 0 {
		t.Errorf("no STATUS=backing-off with the error while PostgreSQL was unreachable:\n%s", sock.lines())
	}
	backingOff := sock.times("WATCHDOG=1")
	if len(backingOff) < 3 {
		t.Fatalf("%d watchdog pings while the restart loop was turning, want them to go on:\n%s", len(backingOff), sock.lines())
	}
	if gap := maxGap(backingOff, time.Now()); gap >= watchdog {
		t.Errorf("a %v gap between watchdog pings while backing off; systemd would have restarted the relay (WatchdogSec=%v)", gap, watchdog)
	}

	proxy.Resume()
	harness.WaitFor(t, time.Minute, "READY=1 after PostgreSQL came back", func() bool { return sock.count("READY=1") > 0 })
	// The relay marks itself streaming before it notifies, so whatever
	// we observe now must already say streaming.
	if code, body := harness.HTTPGet(t, base+"/readyz"); code != http.StatusOK {
		t.Errorf("READY=1 arrived but /readyz says %d %q", code, body)
	}
	if si := cluster.SlotInfo(t, e.DB.Name(), e.Slot); !si.Active {
		t.Errorf("READY=1 arrived but the slot is not active: %+v", si)
	}
	if !strings.Contains(p.Output(), `"message":"streaming"`) {
		harness.WaitFor(t, 10*time.Second, "the streaming log line", func() bool { return strings.Contains(p.Output(), `"message":"streaming"`) })
	}
	ready := sock.times("READY=1")[0]

	// Streaming (idle and then busy): pings keep coming within WatchdogSec.
	insert(t, e.DB.DSN(), "order", 20)
	sock.checkPingsSince(t, ready, "streaming", watchdog)

	// SIGTERM: STOPPING=1 goes out at the start of the shutdown, before the
	// process exits, and nothing follows it.
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 30*time.Second, "STOPPING=1 after SIGTERM", func() bool { return sock.count("STOPPING=1") > 0 })
	code, err := p.Wait(time.Minute)
	if err != nil || code != 0 {
		t.Fatalf("relay exited %d (%v) after SIGTERM, want 0", code, err)
	}
	sock.readAll(t)
	if n := sock.count("STOPPING=1"); n != 1 {
		t.Errorf("STOPPING=1 sent %d times, want once:\n%s", n, sock.lines())
	}
	stop := sock.times("STOPPING=1")[0]
	for _, at := range sock.times("WATCHDOG=1") {
		if at.After(stop) {
			t.Errorf("a watchdog ping after STOPPING=1:\n%s", sock.lines())
			break
		}
	}
	if n := sock.count("READY=1"); n != 1 {
		t.Errorf("READY=1 sent %d times, want once:\n%s", n, sock.lines())
	}
}

// A relay whose loop is stuck must stop pinging, so systemd restarts it.
// The reproducible wedge: a PostgreSQL that accepts TCP connections and
// never answers (a hung server or pooler, a half-open firewall), which
// leaves the connect hanging when the DSN has no connect_timeout.
func TestNotifyWatchdogStopsWhenTheRelayIsWedged(t *testing.T) {
	t.Parallel()
	const watchdog = time.Second
	e := newEnv(t)
	e.Migrate()
	hole := blackhole(t)
	dsn := strings.Replace(e.DB.DSN(), fmt.Sprintf(":%d/", cluster.Port()), fmt.Sprintf(":%d/", hole.port()), 1)
	sock := listenNotify(t)
	p := e.start(e.argsAs(dsn, "run"), sock.env(watchdog)...)
	base := p.AdminURL(t)
	harness.WaitFor(t, time.Minute, "the relay to connect to the silent server", func() bool { return hole.accepted() > 0 })
	harness.WaitFor(t, time.Minute, "a first watchdog ping", func() bool { return sock.count("WATCHDOG=1") > 0 })
	harness.WaitFor(t, time.Minute, fmt.Sprintf("watchdog pings to stop for 3×WatchdogSec (%v)", 3*watchdog), func() bool {
		pings := sock.times("WATCHDOG=1")
		return time.Since(pings[len(pings)-1]) > 3*watchdog
	})
	if code, body := harness.HTTPGet(t, base+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "connecting") {
		t.Errorf("a relay stuck connecting answers /readyz %d %q, want 503 connecting", code, body)
	}
	if p.Exited() {
		t.Fatalf("the relay exited; the point is that it hangs:\n%s", harness.LastLines(p.Output(), 20))
	}
	if sock.count("READY=1") != 0 {
		t.Errorf("READY=1 from a relay that never streamed:\n%s", sock.lines())
	}
}

// silentServer accepts TCP connections and never sends a byte.
type silentServer struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
	wg    sync.WaitGroup
}

func blackhole(t *testing.T) *silentServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &silentServer{ln: ln}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if err != nil {
				continue
			}
			s.mu.Lock()
			s.conns = append(s.conns, c)
			s.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		s.wg.Wait()
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, c := range s.conns {
			c.Close()
		}
	})
	return s
}

func (s *silentServer) port() int { return s.ln.Addr().(*net.TCPAddr).Port }

func (s *silentServer) accepted() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// Poll mode under Type=notify with WatchdogSec=2s: watchdog pings while its
// session restarts (PostgreSQL unreachable) and while it polls an idle
// table, READY=1 once it polls, STOPPING=1 at SIGTERM and exit 0.
func TestNotifyPollMode(t *testing.T) {
	t.Parallel()
	const watchdog = 2 * time.Second
	e := newEnv(t)
	harness.Migrate(t, e.Bin, e.Args("migrate", "--source", "poll"))
	proxy := harness.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", cluster.Port()))
	proxy.Pause()
	dsn := strings.Replace(e.DB.DSN(), fmt.Sprintf(":%d/", cluster.Port()), fmt.Sprintf(":%d/", proxy.Port()), 1)
	sock := listenNotify(t)
	p := e.start(e.argsAs(dsn, "run", "--source", "poll"), sock.env(watchdog)...)
	harness.WaitFor(t, time.Minute, "three watchdog pings while PostgreSQL is unreachable", func() bool { return sock.count("WATCHDOG=1") >= 3 })
	if n := sock.count("READY=1"); n != 0 {
		t.Fatalf("READY=1 sent while the poller could not reach PostgreSQL:\n%s", sock.lines())
	}
	if gap := maxGap(sock.times("WATCHDOG=1"), time.Now()); gap >= watchdog {
		t.Errorf("a %v gap between watchdog pings while backing off (WatchdogSec=%v):\n%s", gap, watchdog, sock.lines())
	}

	proxy.Resume()
	harness.WaitFor(t, time.Minute, "READY=1 once it polls", func() bool { return sock.count("READY=1") > 0 })
	if n := sock.count("STATUS=polling"); n != 1 {
		t.Errorf("READY=1 came with %d STATUS=polling lines, want 1:\n%s", n, sock.lines())
	}
	ready := sock.times("READY=1")[0]
	sock.checkPingsSince(t, ready, "polling", watchdog)
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	code, err := p.Wait(time.Minute)
	if err != nil || code != 0 {
		t.Fatalf("poller exited %d (%v) after SIGTERM, want 0:\n%s", code, err, p.Output())
	}
	sock.readAll(t)
	if n := sock.count("STOPPING=1"); n != 1 {
		t.Errorf("STOPPING=1 sent %d times, want once:\n%s", n, sock.lines())
	}
}
