//go:build !linux

package tcpdial

import (
	"syscall"
	"time"
)

// setUserTimeout does nothing where TCP_USER_TIMEOUT does not exist: the
// keepalives still bound an idle connection, and every request's own
// timeout a busy one.
func setUserTimeout(syscall.RawConn, time.Duration) error { return nil }
