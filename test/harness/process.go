package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/outbox-relay/outbox-relay/internal/throwaway"
)

// local holds the teardown of everything the harness started that must
// not outlive the test binary: clusters (including ones started in
// TestMain), child processes, Apache Kafka, build directories. It is the
// package's only global state besides the relay build cache, and it exists
// because Main, which runs after all tests and on SIGINT/SIGTERM, has no
// other way to reach them.
var local throwaway.Services

// Main runs the package's tests and then stops whatever the harness
// started that is still running. Use it as
//
//	func TestMain(m *testing.M) { harness.Main(m) }
//
// or call it from a longer TestMain after starting shared servers (e.g.
// with StartPostgresMain). Before running tests it stops and deletes
// clusters and directories left behind by earlier test binaries that died
// without cleaning up (SIGKILL, a test timeout); directories still owned by
// a running test binary, such as another package's tests running in
// parallel, are left alone. SIGINT and SIGTERM also stop everything before
// the binary exits.
func Main(m *testing.M) {
	throwaway.ReapOrphans()

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		select {
		case sig := <-sigs:
			fmt.Fprintf(os.Stderr, "harness: got %v, stopping servers and processes\n", sig)
			local.Close()
			os.Exit(1)
		case <-done:
		}
	}()

	// Returning hands m.Run's result to the test wrapper's os.Exit.
	m.Run()
	signal.Stop(sigs)
	close(done)
	local.Close()
}

// MainWithPostgres is Main for a package whose tests share one cluster,
// each test with a database of its own (CreateRelayDatabase): it starts
// the cluster with opts, hands it to share, which keeps it in a package
// variable, and runs Main, which stops it after the tests. A cluster that
// does not start ends the test binary with the reason.
func MainWithPostgres(m *testing.M, opts PGOptions, share func(*Postgres)) {
	pg, _, err := StartPostgresMain(opts)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: start postgres: %v\n", filepath.Base(os.Args[0]), err)
		os.Exit(1)
	}
	share(pg)
	Main(m)
}

// ProcessCPU is the CPU time process pid has used so far, all its threads
// (exited ones included), from the kernel's per-process CPU clock
// (clock_getcpuclockid(3)) in nanoseconds. utime and stime in
// /proc/<pid>/stat, and the process_cpu_seconds_total metric made from
// them, count in ticks of 10 ms: too coarse for a short measurement.
func ProcessCPU(pid int) (time.Duration, error) {
	// The clock id of a process's CPU clock, as glibc makes it:
	// (~pid << 3) | CPUCLOCK_SCHED.
	clock := int32((^pid)<<3 | 2)
	var ts syscall.Timespec
	if _, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, uintptr(clock), uintptr(unsafe.Pointer(&ts)), 0); errno != 0 {
		return 0, fmt.Errorf("cpu clock of process %d: %w", pid, errno)
	}
	return time.Duration(ts.Nano()), nil
}

// builds caches each program's build for the test binary: building once
// rather than per test keeps suites fast.
var builds struct {
	mu sync.Mutex
	m  map[string]*build
}

type build struct {
	once sync.Once
	path string
	out  string
	err  error
}

// BuildRelay builds ./cmd/outbox-relay (CGO_ENABLED=0) once per test binary
// and returns the binary's path. The binary lives in a temp directory that
// Main deletes after the tests. A failed build fails the test with the
// compiler output.
func BuildRelay(t testing.TB) string {
	t.Helper()
	return BuildProgram(t, "./cmd/outbox-relay")
}

// BuildProgram is BuildRelay for any main package of the module, given as
// a path from the module root (e.g. "./test/pattern/consumer").
func BuildProgram(t testing.TB, pkg string) string {
	t.Helper()
	builds.mu.Lock()
	if builds.m == nil {
		builds.m = map[string]*build{}
	}
	b := builds.m[pkg]
	if b == nil {
		b = &build{}
		builds.m[pkg] = b
	}
	builds.mu.Unlock()
	b.once.Do(func() { b.path, b.out, b.err = buildProgram(pkg) })
	if b.err != nil {
		t.Fatalf("build %s: %v\n%s", pkg, b.err, b.out)
	}
	return b.path
}

func buildProgram(pkg string) (path, output string, err error) {
	root, err := moduleRoot()
	if err != nil {
		return "", "", err
	}
	dir, err := throwaway.MakeOwnedTempDir("outbox-relay-build-")
	if err != nil {
		return "", "", err
	}
	local.OnClose(func() { os.RemoveAll(dir) })
	goBin, err := exec.LookPath("go")
	if err != nil {
		return "", "", fmt.Errorf("find go tool: %w", err)
	}
	path = filepath.Join(dir, filepath.Base(pkg))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, goBin, "build", "-o", path, pkg)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", string(out), fmt.Errorf("go build %s: %w", pkg, err)
	}
	return path, string(out), nil
}

// moduleRoot walks up from the working directory (the package under test)
// to the directory holding go.mod.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("working dir: %w", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

// Process is a running child process with its stdout and stderr captured.
// The child runs in its own process group, so Kill also reaches anything it
// spawned, and a Ctrl-C in the terminal reaches only the test binary, whose
// Main then stops the child.
type Process struct {
	name string
	cmd  *exec.Cmd
	out  *syncBuffer
	// stdout is the child's standard output alone, when it was started
	// with StartProcessSplit; out then holds its standard error.
	stdout  *syncBuffer
	logPath string

	done chan struct{} // closed once the child was reaped

	unregister func()
}

// childEnviron is the test's environment without its OUTBOX_RELAY_
// variables: those configure the test suite (OUTBOX_RELAY_REQUIRE_*,
// OUTBOX_RELAY_PG_VERSION, ...), and the relay would read them as its own
// settings, or warn that they set nothing. A test passes what a child
// should get in env.
func childEnviron() []string {
	var out []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OUTBOX_RELAY_") {
			out = append(out, kv)
		}
	}
	return out
}

// StartProcess starts bin with args. env entries are added to the test's
// own environment, later entries winning. Output is kept in memory and in a
// log file; if the test fails, its tail is logged. The process (group) is
// killed when the test ends.
func StartProcess(t testing.TB, bin string, args []string, env []string) *Process {
	t.Helper()
	return startProcess(t, bin, args, env, false)
}

// StartProcessSplit is StartProcess keeping the child's standard output
// apart from its standard error (logs): Stdout returns it, Output the
// logs.
func StartProcessSplit(t testing.TB, bin string, args []string, env []string) *Process {
	t.Helper()
	return startProcess(t, bin, args, env, true)
}

// Stdout is the child's standard output, when it was started with
// StartProcessSplit.
func (p *Process) Stdout() string { return p.stdout.String() }

func startProcess(t testing.TB, bin string, args []string, env []string, split bool) *Process {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), filepath.Base(bin)+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatalf("start %s: create log: %v", bin, err)
	}
	p := &Process{
		name:    filepath.Base(bin),
		out:     &syncBuffer{},
		logPath: logPath,
		done:    make(chan struct{}),
	}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = append(childEnviron(), env...)
	w := io.MultiWriter(p.out, logFile)
	p.cmd.Stdout, p.cmd.Stderr = w, w
	if split {
		p.stdout = &syncBuffer{}
		p.cmd.Stdout = p.stdout
	}
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// A grandchild that inherited stdout must not keep Wait from
	// returning after the child itself exited.
	p.cmd.WaitDelay = 2 * time.Second
	if err := p.cmd.Start(); err != nil {
		logFile.Close()
		t.Fatalf("start %s: %v", bin, err)
	}
	go func() {
		// The exit status is read from ProcessState; the error
		// adds nothing to it.
		_ = p.cmd.Wait()
		logFile.Close()
		close(p.done)
	}()
	p.unregister = local.OnClose(p.Kill)
	t.Cleanup(func() {
		p.Kill()
		p.unregister()
		if t.Failed() {
			t.Logf("%s (pid %d) output tail (%s):\n%s", p.name, p.Pid(), p.logPath, LastLines(p.Output(), 50))
		}
	})
	return p
}

// Pid is the child's process id (and process group id).
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Output returns everything the process wrote to stdout and stderr so far.
func (p *Process) Output() string { return p.out.String() }

// Exited reports whether the process has exited and been reaped.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Signal sends sig to the process itself (not its group).
func (p *Process) Signal(sig os.Signal) error {
	if p.Exited() {
		return errors.New("process already exited")
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal %v: %w", sig, err)
	}
	return nil
}

// Kill SIGKILLs the process group and waits for the process to be reaped.
// It is safe to call more than once and after the process exited.
func (p *Process) Kill() {
	// The group may outlive its leader, so kill it even after an exit.
	_ = syscall.Kill(-p.Pid(), syscall.SIGKILL)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		// Only an unkillable (D state) process gets here; nothing
		// better to do than to stop waiting.
	}
}

// Wait waits up to timeout for the process to exit and returns its exit
// code: the status it exited with, or 128+signal number when a signal
// killed it (the shell convention, so SIGKILL gives 137).
func (p *Process) Wait(timeout time.Duration) (exitCode int, err error) {
	select {
	case <-p.done:
		return p.exitCode(), nil
	case <-time.After(timeout):
		return -1, fmt.Errorf("%s still running after %v", p.name, timeout)
	}
}

// Stop sends SIGTERM and waits up to timeout for the process to exit; then
// it SIGKILLs the group and reports an error along with the exit code.
func (p *Process) Stop(timeout time.Duration) (exitCode int, err error) {
	if p.Exited() {
		return p.exitCode(), nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	if code, err := p.Wait(timeout); err == nil {
		return code, nil
	}
	p.Kill()
	return p.exitCode(), fmt.Errorf("%s did not exit within %v of SIGTERM; killed", p.name, timeout)
}

func (p *Process) exitCode() int {
	st := p.cmd.ProcessState
	if st == nil {
		return -1
	}
	if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return st.ExitCode()
}

// WaitForOutput waits until the process's output contains substr, failing
// the test at timeout or as soon as the process exits without printing it.
func (p *Process) WaitForOutput(t testing.TB, substr string, timeout time.Duration) {
	t.Helper()
	found := func() bool { return strings.Contains(p.Output(), substr) }
	Poll(timeout, func() bool { return found() || p.Exited() })
	if found() {
		return
	}
	if p.Exited() {
		t.Fatalf("%s exited (code %d) without printing %q; output tail:\n%s",
			p.name, p.exitCode(), substr, LastLines(p.Output(), 30))
	}
	t.Fatalf("%s did not print %q within %v; output tail:\n%s",
		p.name, substr, timeout, LastLines(p.Output(), 30))
}

// syncBuffer is a bytes.Buffer safe for the writer goroutine and readers.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
