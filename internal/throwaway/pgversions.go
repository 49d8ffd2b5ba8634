package throwaway

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
)

// PGVersionEnv selects the PostgreSQL major version every cluster of the
// process runs, e.g. OUTBOX_RELAY_PG_VERSION=17. Debian's server is
// used where /usr/lib/postgresql/<major>/bin has one (15 here); 16, 17 and
// 18 come from test/postgres/fetch.sh's cache. Unset, StartPostgres takes
// OUTBOX_RELAY_PG_BIN, else the newest Debian server.
const PGVersionEnv = "OUTBOX_RELAY_PG_VERSION"

// FetchedPGVersions are the majors test/postgres/fetch.sh pins, with the
// exact release of each; keep the two in step (TestFetchScriptPinsPGVersions
// checks it).
func FetchedPGVersions() map[int]string {
	return map[int]string{16: "16.10.0", 17: "17.5.0", 18: "18.1.0"}
}

// RequestedPGMajor is the major version PGVersionEnv asks for, 0 if unset.
func RequestedPGMajor() (int, error) {
	v := os.Getenv(PGVersionEnv)
	if v == "" {
		return 0, nil
	}
	major, err := strconv.Atoi(v)
	if err != nil || major < 10 {
		return 0, fmt.Errorf("%s=%q: want a major version such as 17", PGVersionEnv, v)
	}
	return major, nil
}

// versionedPGBinDir returns the bin directory of the requested major. A
// fetched installation is copied once per Services: the fetch cache lives
// under the invoking user's home, which the postgres user a root caller
// runs the server as cannot enter.
func (s *Services) versionedPGBinDir(major int) (string, error) {
	debian := fmt.Sprintf("/usr/lib/postgresql/%d/bin", major)
	if _, err := os.Stat(filepath.Join(debian, "initdb")); err == nil {
		return debian, nil
	}
	if _, ok := FetchedPGVersions()[major]; !ok {
		return "", fmt.Errorf("PostgreSQL %d: neither installed in %s nor fetched by test/postgres/fetch.sh (it fetches 16, 17 and 18)", major, debian)
	}
	s.pgInstall.once.Do(func() { s.pgInstall.bin, s.pgInstall.err = s.copyFetchedPG(major) })
	return s.pgInstall.bin, s.pgInstall.err
}

// copyFetchedPG copies the fetched installation of major into a directory
// of its own that every user may read, removed when s closes.
func (s *Services) copyFetchedPG(major int) (string, error) {
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("locate cache dir: %w", err)
		}
		cache = filepath.Join(home, ".cache")
	}
	src := filepath.Join(cache, "outbox-relay", fmt.Sprintf("postgres-%d", major))
	if _, err := os.Stat(filepath.Join(src, "fetched.stamp")); err != nil {
		return "", fmt.Errorf("PostgreSQL %d is not fetched into %s: run test/postgres/fetch.sh %d", major, src, major)
	}
	dir, err := MakeOwnedTempDir(fmt.Sprintf("outbox-relay-pg%d-install-", major))
	if err != nil {
		return "", err
	}
	s.OnClose(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", fmt.Errorf("chmod %s: %w", dir, err)
	}
	dst := filepath.Join(dir, "pg")
	if out, err := exec.Command("cp", "-a", src, dst).CombinedOutput(); err != nil {
		return "", fmt.Errorf("copy PostgreSQL %d from %s: %w: %s", major, src, err, out)
	}
	if out, err := exec.Command("chmod", "-R", "a+rX", dst).CombinedOutput(); err != nil {
		return "", fmt.Errorf("chmod PostgreSQL %d: %w: %s", major, err, out)
	}
	return filepath.Join(dst, "bin"), nil
}
