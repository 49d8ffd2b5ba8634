package main

import (
	"errors"
	"os/exec"
	"path/filepath"
	"testing"
)

// --skip writer was documented but refused ("--skip \"writer\": ceiling,
// bigtxn, ..."), so the writer part could not be left out.
func TestSkipTakesEveryPart(t *testing.T) {
	for _, part := range []string{"ceiling", "bigtxn", "latency", "steady", "floor", "allocs", "reconcile", "eos", "writer"} {
		o, err := parseOptions([]string{"--skip", part})
		if err != nil || !o.skip[part] {
			t.Errorf("--skip %s: %v", part, err)
		}
	}
	if _, err := parseOptions([]string{"--skip", "everything"}); err == nil {
		t.Error("--skip everything accepted")
	}
}

// A run with the default --out leaves the working tree as it was: git
// ignores every file the bench writes there.
func TestDefaultOutIsIgnoredByGit(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("no git here")
	}
	o, err := parseOptions(nil)
	if err != nil {
		t.Fatal(err)
	}
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	if err := exec.Command("git", "-C", root, "rev-parse", "--git-dir").Run(); err != nil {
		t.Skip("not a git checkout")
	}
	for _, name := range []string{"latest.md", "latest.json", "20260102-030405.md", "20260102-030405.json", "history.md"} {
		err := exec.Command("git", "-C", root, "check-ignore", "-q", filepath.Join(o.out, name)).Run()
		var exit *exec.ExitError
		switch {
		case errors.As(err, &exit) && exit.ExitCode() == 1:
			t.Errorf("git would track %s, which the bench writes by default", filepath.Join(o.out, name))
		case err != nil:
			t.Fatalf("git check-ignore: %v", err)
		}
	}
}
