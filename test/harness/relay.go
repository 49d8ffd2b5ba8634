package harness

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/throwaway"
)

// LogStreaming is what the relay logs, in its JSON output, once it streams.
const LogStreaming = `"message":"streaming"`

// LogLevelInfo is the environment entry that keeps the relay's info lines
// (progress, restarts), which tests wait on; StartProcess passes a child
// none of the suite's own OUTBOX_RELAY_ variables.
const LogLevelInfo = "OUTBOX_RELAY_LOG_LEVEL=info"

// RelayFlags point a relay command at a test's database, slot and Kafka.
type RelayFlags struct {
	DSN     string
	Slot    string
	Brokers []string
	// AdminAddr is --admin-addr for run; "" turns the endpoint off, and
	// "127.0.0.1:0" picks a free port that Process.AdminURL reads back.
	AdminAddr string
	// Topic is --topic for run; "" keeps the relay's default template.
	Topic string
}

// Args is cmd's command line: the database and slot, for run also Kafka,
// the admin address and the topic, then extra, which may override any of
// them (the last flag wins).
func (f RelayFlags) Args(cmd string, extra ...string) []string {
	a := []string{cmd, "--pg-dsn", f.DSN, "--slot", f.Slot}
	if cmd == "run" {
		a = append(a, "--kafka-brokers", strings.Join(f.Brokers, ","), "--admin-addr", f.AdminAddr)
		if f.Topic != "" {
			a = append(a, "--topic", f.Topic)
		}
	}
	return append(a, extra...)
}

// RunCommand runs a short relay command (migrate, status, quarantine) to
// its end and returns its exit code and output; a command still running
// after two minutes fails the test.
func RunCommand(t testing.TB, bin string, args []string, env ...string) (exitCode int, output string) {
	t.Helper()
	p := StartProcess(t, bin, args, env)
	code, err := p.Wait(2 * time.Minute)
	if err != nil {
		t.Fatalf("%s: %v\n%s", args[0], err, p.Output())
	}
	return code, p.Output()
}

// Migrate runs the relay's migrate command with args and fails the test
// unless it exits 0.
func Migrate(t testing.TB, bin string, args []string, env ...string) {
	t.Helper()
	if code, out := RunCommand(t, bin, args, env...); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
}

// StartStreaming starts the relay's run command and waits until it logs
// that it streams.
func StartStreaming(t testing.TB, bin string, args []string, env ...string) *Process {
	t.Helper()
	p := StartProcess(t, bin, args, env)
	p.WaitForOutput(t, LogStreaming, 2*time.Minute)
	return p
}

var adminAddrField = regexp.MustCompile(`"admin_addr":"([^"]+)"`)

// AdminURL is the base URL of the relay's admin endpoint, read from the
// address it logs once listening (so --admin-addr 127.0.0.1:0 works).
func (p *Process) AdminURL(t testing.TB) string {
	t.Helper()
	p.WaitForOutput(t, `"admin_addr"`, time.Minute)
	m := adminAddrField.FindStringSubmatch(p.Output())
	if m == nil {
		t.Fatalf("no admin_addr in the relay's output:\n%s", LastLines(p.Output(), 30))
	}
	return "http://" + m[1]
}

// PeakRSS is a process's high-water resident set size (VmHWM) in bytes.
func PeakRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("peak rss: %w", err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		rest, ok := strings.CutPrefix(line, "VmHWM:")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("peak rss: %q: %w", line, err)
		}
		return kb << 10, nil
	}
	return 0, errors.New("peak rss: no VmHWM line")
}

// LogLine is one JSON line of the relay's log, loosely typed.
type LogLine map[string]any

// LogLines parses the relay's JSON log lines out of its output; other
// lines are skipped.
func LogLines(out string) []LogLine {
	var lines []LogLine
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		b := sc.Bytes()
		if len(b) == 0 || b[0] != '{' {
			continue
		}
		var l LogLine
		if json.Unmarshal(b, &l) == nil {
			lines = append(lines, l)
		}
	}
	return lines
}

// Str is field key of the line as text, "" when absent.
func (l LogLine) Str(key string) string {
	switch v := l[key].(type) {
	case string:
		return v
	case float64:
		return strconv.FormatFloat(v, 'f', -1, 64)
	case nil:
		return ""
	default:
		return fmt.Sprint(v)
	}
}

// LastLines is the tail of a process's output, for failure messages.
func LastLines(s string, n int) string { return throwaway.LastLines(s, n) }
