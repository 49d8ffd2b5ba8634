package throwaway

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// ownerFile marks a temporary directory with the pid and start time of the
// process that created it; the start time tells a live owner from an
// unrelated process that reused its pid.
const ownerFile = ".harness-owner"

// orphanGlob matches every directory MakeOwnedTempDir may have made for
// this project (its prefixes all start with "outbox-relay-").
const orphanGlob = "outbox-relay-*"

// MakeOwnedTempDir creates a directory under os.TempDir() whose name starts
// with prefix (which must start with "outbox-relay-"), marked so that
// ReapOrphans in a later process may delete it once this process is gone.
func MakeOwnedTempDir(prefix string) (string, error) {
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return "", fmt.Errorf("create temp dir: %w", err)
	}
	self := os.Getpid()
	marker := fmt.Sprintf("%d %s\n", self, procStartTime(self))
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(marker), 0o644); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("write owner marker: %w", err)
	}
	return dir, nil
}

// ReapOrphans removes marked directories whose owner is dead (it was
// SIGKILLed, or a test timeout killed it), first stopping a PostgreSQL
// cluster still running from one of them. Directories of a live owner,
// such as another test binary running in parallel, are left alone.
func ReapOrphans() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), orphanGlob))
	for _, dir := range dirs {
		b, err := os.ReadFile(filepath.Join(dir, ownerFile))
		if err != nil {
			continue // not ours, or being created right now
		}
		fields := strings.Fields(string(b))
		if len(fields) == 0 {
			continue
		}
		pid, err := strconv.Atoi(fields[0])
		if err != nil {
			continue
		}
		start := ""
		if len(fields) > 1 {
			start = fields[1]
		}
		if processAlive(pid) && procStartTime(pid) == start {
			continue
		}
		killPostmaster(filepath.Join(dir, "data"))
		os.RemoveAll(dir)
	}
}

func procAvailable() bool {
	_, err := os.Stat("/proc/self/stat")
	return err == nil
}

// procStartTime is the process start time in clock ticks since boot (field
// 22 of /proc/<pid>/stat), or "" where there is no /proc.
func procStartTime(pid int) string {
	f := procStatFields(pid)
	if len(f) < 20 {
		return ""
	}
	return f[19]
}

// processAlive reports whether pid is running. A zombie counts as dead: an
// orphaned postmaster is reparented to PID 1, and in a container that may
// never reap it.
func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	if err != nil && !errors.Is(err, syscall.EPERM) {
		return false
	}
	return procState(pid) != "Z"
}

// procState is the state letter of /proc/<pid>/stat (R, S, D, Z, ...), or
// "" where there is no /proc.
func procState(pid int) string {
	f := procStatFields(pid)
	if len(f) < 1 {
		return ""
	}
	return f[0]
}

// procStatFields returns the fields of /proc/<pid>/stat from field 3 on.
// The command name (field 2) may contain spaces and parentheses, so the
// split starts after its closing parenthesis.
func procStatFields(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}
