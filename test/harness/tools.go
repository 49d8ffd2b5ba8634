package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"
)

// RequireTool finds a command-line tool, or skips the test loudly; with
// requireEnv=1 in the environment a missing tool fails it instead (CI sets
// it, so a tool that went missing there cannot pass unnoticed).
func RequireTool(t testing.TB, tool, debianPackage, requireEnv string) string {
	t.Helper()
	path, err := exec.LookPath(tool)
	if err == nil {
		return path
	}
	SkipUnlessRequired(t, requireEnv, fmt.Sprintf("%s not found (Debian package %s): this test cannot run", tool, debianPackage))
	return ""
}

// SkipUnlessRequired skips the test with why, or fails it when requireEnv=1
// is in the environment.
func SkipUnlessRequired(t testing.TB, requireEnv, why string) {
	t.Helper()
	msg := fmt.Sprintf("%s; set %s=1 to make that a failure", why, requireEnv)
	if os.Getenv(requireEnv) == "1" {
		t.Fatal(msg)
	}
	t.Log("SKIP: " + msg)
	t.Skip(msg)
}

// RunTool runs a tool to its end, within two minutes, and returns its
// combined output.
func RunTool(t testing.TB, name string, args ...string) (string, error) {
	t.Helper()
	return RunToolWithin(t, 2*time.Minute, name, args...)
}

// RunToolWithin is RunTool with its own time limit.
func RunToolWithin(t testing.TB, limit time.Duration, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	return string(out), err
}
