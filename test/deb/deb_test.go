// Package deb tests the Debian package `make deb` builds: its version,
// and, as root with dpkg, what installing, removing, reinstalling,
// upgrading and purging it does to the machine: the binary, the systemd
// units, the configuration (a conffile that an edit survives), the
// service user and the permissions.
//
// The install test changes the machine (a package, a user, files under
// /etc, /lib and /usr) and undoes it with dpkg --purge. It skips, loudly,
// unless it runs as root with dpkg; OUTBOX_RELAY_REQUIRE_DPKG=1 (which CI
// sets) makes that a failure.
package deb

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

const (
	requireEnv = "OUTBOX_RELAY_REQUIRE_DPKG"
	pkg        = "outbox-relay"
	confDir    = "/etc/outbox-relay"
	conffile   = confDir + "/outbox-relay.yaml"
	binary     = "/usr/bin/outbox-relay"
	unitDir    = "/lib/systemd/system"
)

// repoRoot is the module root, from this package's directory.
const repoRoot = "../.."

// run runs a command to its end and fails the test unless it exits 0;
// it returns the combined output.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := harness.RunTool(t, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

// makeOutput runs make in the repository with args and returns its output,
// trimmed.
func makeOutput(t *testing.T, args ...string) string {
	t.Helper()
	return strings.TrimSpace(run(t, "make", append([]string{"-C", repoRoot, "-s", "--no-print-directory"}, args...)...))
}

// The package version is git describe made valid for Debian, and ordered
// the way releases are: a pre-release before its release, the commits
// after a tag after it, and the next tag after those.
func TestDebVersion(t *testing.T) {
	t.Parallel()
	harness.RequireTool(t, "make", "make", requireEnv)
	dpkg := harness.RequireTool(t, "dpkg", "dpkg", requireEnv)
	cases := []struct{ describe, want string }{
		{"v1.2.3", "1.2.3"},
		{"v1.2.3-4-gabc1234", "1.2.3+4.gabc1234"},
		{"v1.2.3-4-gabc1234-dirty", "1.2.3+4.gabc1234+dirty"},
		{"v1.3.0-rc.1", "1.3.0~rc.1"},
		{"v1.3.0-rc.1-2-gdeadbee", "1.3.0~rc.1+2.gdeadbee"},
		{"1.4.0", "1.4.0"},
		// No tag yet: git describe --always gives the abbreviated
		// commit, which may be all digits.
		{"0802d2a", "0.0.0+0802d2a"},
		{"1234567-dirty", "0.0.0+1234567+dirty"},
		{"dev", "0.0.0+dev"},
	}
	got := map[string]string{}
	for _, c := range cases {
		v := makeOutput(t, "deb-version", "VERSION="+c.describe)
		got[c.describe] = v
		if v != c.want {
			t.Errorf("VERSION=%s: package version %q, want %q", c.describe, v, c.want)
		}
		// Valid for dpkg, and a fixed point: a version that is
		// already a package version stays as it is.
		if out, err := harness.RunTool(t, dpkg, "--validate-version", v); err != nil {
			t.Errorf("VERSION=%s: dpkg refuses %q: %v %s", c.describe, v, err, out)
		}
		if again := makeOutput(t, "deb-version", "VERSION="+v); again != v {
			t.Errorf("VERSION=%s: %q maps to %q again", c.describe, v, again)
		}
	}
	ascending := []string{"v1.2.3", "v1.2.3-4-gabc1234", "v1.2.3-4-gabc1234-dirty", "v1.3.0-rc.1", "v1.3.0-rc.1-2-gdeadbee", "1.4.0"}
	for i := 1; i < len(ascending); i++ {
		lower, higher := got[ascending[i-1]], got[ascending[i]]
		if out, err := harness.RunTool(t, dpkg, "--compare-versions", lower, "lt", higher); err != nil {
			t.Errorf("dpkg does not order %s (%s) before %s (%s): %v %s", lower, ascending[i-1], higher, ascending[i], err, out)
		}
	}
}

// owner is a path's permission bits and its owner's and group's names.
func owner(t *testing.T, path string) string {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	u, g := strconv.FormatUint(uint64(st.Uid), 10), strconv.FormatUint(uint64(st.Gid), 10)
	if found, err := user.LookupId(u); err == nil {
		u = found.Username
	}
	if found, err := user.LookupGroupId(g); err == nil {
		g = found.Name
	}
	return fmt.Sprintf("%04o %s:%s", fi.Mode().Perm(), u, g)
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return !errors.Is(err, os.ErrNotExist)
}

// buildDeb runs make deb into dir, with more make variables, and returns
// the package file and its version.
func buildDeb(t *testing.T, dir string, vars ...string) (file, version string) {
	t.Helper()
	args := append([]string{"-C", repoRoot, "--no-print-directory", "deb", "DEB_DIR=" + dir, "BIN=" + filepath.Join(dir, "outbox-relay")}, vars...)
	// make deb's -trimpath build compiles every dependency again (go
	// test's build cache does not serve it): on the 2-core machine, with
	// the other test packages running, that once took over two minutes.
	out, err := harness.RunToolWithin(t, 10*time.Minute, "make", args...)
	if err != nil {
		t.Fatalf("make %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	matches, _ := filepath.Glob(filepath.Join(dir, "*.deb"))
	if len(matches) != 1 {
		t.Fatalf("make deb made %d packages in %s:\n%s", len(matches), dir, out)
	}
	return matches[0], strings.TrimSpace(run(t, "dpkg-deb", "--field", matches[0], "Version"))
}

// installed is the package's state as dpkg knows it ("installed",
// "config-files", ...) and its version; "" when dpkg knows none.
func installed(t *testing.T) (status, version string) {
	t.Helper()
	out, err := exec.Command("dpkg-query", "--show", "--showformat", "${db:Status-Status} ${Version}", pkg).Output()
	if err != nil {
		return "", "" // dpkg has never heard of it
	}
	status, version, _ = strings.Cut(strings.TrimSpace(string(out)), " ")
	if status == "not-installed" {
		return "", ""
	}
	return status, version
}

// relayVersion is what the installed binary says its version is.
func relayVersion(t *testing.T) string {
	t.Helper()
	out := strings.TrimSpace(run(t, binary, "version"))
	v, ok := strings.CutPrefix(out, "outbox-relay ")
	if !ok {
		t.Fatalf("%s version printed %q", binary, out)
	}
	return v
}

// The package installs, removes, reinstalls, upgrades and purges the way a
// Debian package should: the binary and both units in place and loading,
// the binary reporting the package's version, the service user created,
// the configuration readable by it and by no one else, an edited
// configuration kept by removal and upgrade, and nothing left after purge.
func TestDebInstallRemoveUpgradePurge(t *testing.T) {
	harness.RequireTool(t, "make", "make", requireEnv)
	harness.RequireTool(t, "dpkg", "dpkg", requireEnv)
	analyze := harness.RequireTool(t, "systemd-analyze", "systemd", "OUTBOX_RELAY_REQUIRE_SYSTEMD_ANALYZE")
	runuser := harness.RequireTool(t, "runuser", "util-linux", requireEnv)
	if os.Geteuid() != 0 {
		harness.SkipUnlessRequired(t, requireEnv, "installing a package needs root")
	}
	// This test purges what it installs: never on a machine where the
	// package, or a user of its name, is in use.
	if status, version := installed(t); status != "" {
		t.Fatalf("dpkg already has %s %s (%s): this test installs and purges it; run it where it is not installed, or dpkg --purge %s first", pkg, version, status, pkg)
	}
	if _, err := user.Lookup(pkg); err == nil {
		t.Fatalf("a user %s exists: this test creates and deletes it with the package; run it where none exists", pkg)
	}

	dir := t.TempDir()
	file, version := buildDeb(t, filepath.Join(dir, "first"))
	t.Logf("built %s", file)
	t.Cleanup(func() {
		out, err := harness.RunTool(t, "dpkg", "--purge", pkg)
		if err != nil {
			t.Errorf("dpkg --purge: %v\n%s", err, out)
		}
		if status, _ := installed(t); status != "" {
			t.Errorf("after purge dpkg still has %s (%s)", pkg, status)
		}
		for _, path := range []string{binary, confDir, unitDir + "/outbox-relay.service", unitDir + "/outbox-relay@.service", "/usr/share/outbox-relay"} {
			if exists(path) {
				t.Errorf("after purge %s is still there", path)
			}
		}
		if _, err := user.Lookup(pkg); err == nil {
			t.Errorf("after purge the user %s is still there", pkg)
		}
		if _, err := user.LookupGroup(pkg); err == nil {
			t.Errorf("after purge the group %s is still there", pkg)
		}
		if out, _ := harness.RunTool(t, "dpkg-statoverride", "--list"); strings.Contains(out, confDir) {
			t.Errorf("after purge dpkg-statoverride still lists %s:\n%s", confDir, out)
		}
	})
	run(t, "dpkg", "--install", file)
	if status, v := installed(t); status != "installed" || v != version {
		t.Fatalf("after dpkg --install: %s %s, want installed %s", status, v, version)
	}

	// The binary reports the version the package has: the Makefile's
	// VERSION (git describe) it was built with, made valid for Debian.
	described := relayVersion(t)
	if v := makeOutput(t, "deb-version", "VERSION="+described); v != version {
		t.Errorf("%s version says %s, which makes package version %s, but the package is %s", binary, described, v, version)
	}
	if out, err := exec.Command("git", "-C", repoRoot, "describe", "--tags", "--always", "--dirty").Output(); err == nil {
		if want := strings.TrimSpace(string(out)); described != want {
			t.Errorf("%s version says %s, git describe %s", binary, described, want)
		}
	}

	// Both units load from where the package put them, the template as an
	// instance; the units start the binary the package installed.
	for _, unit := range []string{"outbox-relay.service", "outbox-relay@orders.service"} {
		out, err := harness.RunTool(t, analyze, "verify", "--man=no", filepath.Join(unitDir, unit))
		if err != nil {
			t.Errorf("systemd-analyze verify %s: %v\n%s", unit, err, out)
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, "outbox-relay") {
				t.Errorf("systemd-analyze verify %s complains: %s", unit, line)
			}
		}
	}
	for _, unit := range []string{"outbox-relay.service", "outbox-relay@.service"} {
		raw, err := os.ReadFile(filepath.Join(unitDir, unit))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(raw), "\nExecStart="+binary+" ") {
			t.Errorf("%s does not start %s", unit, binary)
		}
	}

	// The service user, and a configuration it can read and not write,
	// that no one else can read: the secrets go beside it.
	u, err := user.Lookup(pkg)
	if err != nil {
		t.Fatalf("postinst created no user %s: %v", pkg, err)
	}
	if g, err := user.LookupGroupId(u.Gid); err != nil || g.Name != pkg {
		t.Errorf("the user %s's group is %v (%v), want %s", pkg, g, err, pkg)
	}
	if entry := run(t, "getent", "passwd", pkg); !strings.HasSuffix(strings.TrimSpace(entry), ":/nonexistent:/usr/sbin/nologin") {
		t.Errorf("getent passwd %s: %s, want home /nonexistent and shell /usr/sbin/nologin", pkg, entry)
	}
	for path, want := range map[string]string{
		confDir:  "0750 root:" + pkg,
		conffile: "0640 root:" + pkg,
		binary:   "0755 root:root",
	} {
		if got := owner(t, path); got != want {
			t.Errorf("%s: %s, want %s", path, got, want)
		}
	}
	if out, err := harness.RunTool(t, runuser, "-u", pkg, "--", "cat", conffile); err != nil {
		t.Errorf("the service user cannot read %s: %v %s", conffile, err, out)
	}
	if _, err := harness.RunTool(t, runuser, "-u", pkg, "--", "test", "-w", conffile); err == nil {
		t.Errorf("the service user can write %s", conffile)
	}
	example, err := os.ReadFile(filepath.Join(repoRoot, "deploy", "outbox-relay.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(conffile); err != nil || string(got) != string(example) {
		t.Errorf("%s is not deploy/outbox-relay.yaml (%v)", conffile, err)
	}
	if out := run(t, "dpkg-query", "--show", "--showformat", "${Conffiles}", pkg); !strings.Contains(out, conffile+" ") {
		t.Errorf("%s is not a conffile of the package: %q", conffile, out)
	}
	for src, dst := range map[string]string{
		"deploy/prometheus-alerts.yaml":    "/usr/share/outbox-relay/prometheus-alerts.yaml",
		"deploy/grafana/outbox-relay.json": "/usr/share/outbox-relay/grafana/outbox-relay.json",
		"README.md":                        "/usr/share/doc/outbox-relay/README.md",
		"docs/operations.md":               "/usr/share/doc/outbox-relay/docs/operations.md",
		"docs/reference/flags.md":          "/usr/share/doc/outbox-relay/docs/reference/flags.md",
		"deploy/outbox-relay.1":            "/usr/share/man/man1/outbox-relay.1",
		"deploy/outbox-relay@.service":     unitDir + "/outbox-relay@.service",
	} {
		want, err := os.ReadFile(filepath.Join(repoRoot, src))
		if err != nil {
			t.Fatal(err)
		}
		if got, err := os.ReadFile(dst); err != nil || string(got) != string(want) {
			t.Errorf("%s is not %s (%v)", dst, src, err)
		}
	}

	// man finds the page the package installed, and formats it.
	if _, err := exec.LookPath("man"); err == nil {
		const manPage = "/usr/share/man/man1/outbox-relay.1"
		if out := run(t, "man", "-w", "outbox-relay"); strings.TrimSpace(out) != manPage {
			t.Errorf("man -w outbox-relay: %q, want %s", out, manPage)
		}
		if out := run(t, "man", "-l", manPage); !strings.Contains(out, "EXIT STATUS") || !strings.Contains(out, "OUTBOX_RELAY_PG_DSN") {
			t.Errorf("man -l %s does not show the page's sections:\n%s", manPage, out)
		}
	} else {
		t.Log("man is not installed: the man page is checked as a file only")
	}

	// An operator's edit survives removal, which keeps /etc/outbox-relay
	// and the user but takes the binary and the units.
	edited := append(example, "# edited after install\n"...)
	if err := os.WriteFile(conffile, edited, 0o640); err != nil {
		t.Fatal(err)
	}
	checkEdited := func(when string) {
		t.Helper()
		if got, err := os.ReadFile(conffile); err != nil || string(got) != string(edited) {
			t.Errorf("%s: the edited %s is gone or changed (%v)", when, conffile, err)
		}
		if got := owner(t, conffile); got != "0640 root:"+pkg {
			t.Errorf("%s: %s is %s, want 0640 root:%s", when, conffile, got, pkg)
		}
	}
	run(t, "dpkg", "--remove", pkg)
	if status, _ := installed(t); status != "config-files" {
		t.Errorf("after dpkg --remove: %q, want config-files", status)
	}
	for _, path := range []string{binary, unitDir + "/outbox-relay.service", unitDir + "/outbox-relay@.service"} {
		if exists(path) {
			t.Errorf("after dpkg --remove %s is still there", path)
		}
	}
	checkEdited("after dpkg --remove")
	if _, err := user.Lookup(pkg); err != nil {
		t.Errorf("dpkg --remove deleted the user %s: %v", pkg, err)
	}

	// Reinstalling brings the binary back and keeps the edit.
	run(t, "dpkg", "--install", file)
	if got := relayVersion(t); got != described {
		t.Errorf("reinstalled: version %s, want %s", got, described)
	}
	checkEdited("after reinstalling")

	// An upgrade to a newer build keeps it too.
	newer := version + "+1"
	file2, version2 := buildDeb(t, filepath.Join(dir, "second"), "VERSION="+newer)
	if version2 != newer {
		t.Fatalf("make deb VERSION=%s made version %s", newer, version2)
	}
	run(t, "dpkg", "--install", file2)
	if status, v := installed(t); status != "installed" || v != newer {
		t.Errorf("after the upgrade: %s %s, want installed %s", status, v, newer)
	}
	if got := relayVersion(t); got != newer {
		t.Errorf("after the upgrade %s version says %s, want %s", binary, got, newer)
	}
	checkEdited("after the upgrade")
}
