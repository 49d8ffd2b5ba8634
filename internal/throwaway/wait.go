package throwaway

import (
	"net"
	"strings"
	"time"
)

// pollInterval is short enough that waits add little latency and long
// enough that polling a database or a buffer costs next to nothing on a
// busy two-core CI machine.
const pollInterval = 20 * time.Millisecond

// Poll evaluates cond every ~20ms until it returns true, and reports
// whether it did before timeout. cond is always evaluated at least once,
// and once more after the deadline, so a condition that became true while
// the last interval slept is not reported as a timeout.
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
func FreePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// LastLines is the last n lines of s, for logs in error messages.
func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
