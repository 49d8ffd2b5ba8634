package harness

import (
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/throwaway"
)

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
	return throwaway.Poll(timeout, cond)
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago. The
// port is released before returning, so another process may still take it;
// servers that can retry on a bind failure (StartPostgres does) should.
func FreePort(t testing.TB) int {
	t.Helper()
	port, err := throwaway.FreePort()
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	return port
}
