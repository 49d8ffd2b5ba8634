package harness

import (
	"net"
	"testing"
	"time"
)

// pollInterval is short enough that waits add little latency to a test and
// long enough that polling a database or a buffer costs next to nothing on a
// busy two-core CI machine.
const pollInterval = 20 * time.Millisecond

// WaitFor polls cond every ~20ms until it returns true, and fails the test
// with what when timeout passes first. cond is always evaluated at least
// once, and once more after the deadline, so a condition that became true
// while the last interval slept is not reported as a timeout.
//
// WaitFor calls t.Fatalf, so call it from the test's goroutine only.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if !Poll(timeout, cond) {
		t.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
}

// Poll is WaitFor without the test: it reports whether cond became true
// before timeout, for helpers that want to word their own failure.
func Poll(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	ticker := time.NewTicker(pollInterval)
	defer ticker.Stop()
	for {
		if cond() {
			return true
		}
		if !time.Now().Before(deadline) {
			return false
		}
		<-ticker.C
	}
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago. The
// port is released before returning, so another process may still take it;
// servers that can retry on a bind failure (StartPostgres does) should.
func FreePort(t testing.TB) int {
	t.Helper()
	port, err := freePort()
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	return port
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
