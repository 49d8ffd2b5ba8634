package main

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestCommandsDoNotLinkTesting keeps the test framework out of every binary
// under cmd/: the demo once imported test/harness and so linked package
// testing, with its flags and init, into a binary users run. The demo's
// services come from internal/throwaway, which must stay free of it.
func TestCommandsDoNotLinkTesting(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("this test runs `go list` and needs the go tool on PATH: %v", err)
	}
	cmd := exec.Command(goTool, "list", "-f", `{{.ImportPath}}{{range .Deps}} {{.}}{{end}}`, "./cmd/...")
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		msg := ""
		if ee, ok := err.(*exec.ExitError); ok {
			msg = string(ee.Stderr)
		}
		t.Fatalf("go list ./cmd/...: %v\n%s", err, msg)
	}
	var binaries []string
	for line := range strings.Lines(strings.TrimSpace(string(out))) {
		fields := strings.Fields(line)
		binaries = append(binaries, fields[0])
		if slices.Contains(fields[1:], "testing") {
			t.Errorf("%s links package testing; keep test/harness and other test helpers out of its imports", fields[0])
		}
	}
	if !slices.Contains(binaries, "github.com/outbox-relay/outbox-relay/cmd/outbox-relay-demo") {
		t.Fatalf("go list ./cmd/... did not list the demo, so nothing was checked: %q", binaries)
	}
}
