package harness

import (
	"os"
	"regexp"
	"strconv"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/throwaway"
)

// The versions fetch.sh downloads and the ones the harness expects must be
// the same: a bump of one alone would make the harness look in the wrong
// place, or test a server nobody pinned.
func TestFetchScriptPinsPGVersions(t *testing.T) {
	b, err := os.ReadFile("../postgres/fetch.sh")
	if err != nil {
		t.Fatal(err)
	}
	got := map[int]string{}
	for _, m := range regexp.MustCompile(`(?m)^(\d+) (\d+\.\d+\.\d+) [0-9a-f]{64}$`).FindAllSubmatch(b, -1) {
		major, _ := strconv.Atoi(string(m[1]))
		got[major] = string(m[2])
	}
	want := throwaway.FetchedPGVersions()
	if len(got) != len(want) {
		t.Fatalf("fetch.sh pins %v, the harness expects %v", got, want)
	}
	for major, v := range want {
		if got[major] != v {
			t.Fatalf("fetch.sh pins %v, the harness expects %v", got, want)
		}
	}
}

// With PGVersionEnv set, every cluster is that major version; the
// per-version runs of make test rely on it.
func TestRequestedPGMajorIsWhatRuns(t *testing.T) {
	want, err := throwaway.RequestedPGMajor()
	if err != nil {
		t.Fatal(err)
	}
	if want == 0 {
		t.Skipf("%s is not set: this run uses the default server", PGVersionEnv)
	}
	p := StartPostgres(t, PGOptions{})
	if got := p.Major(t); got != want {
		t.Fatalf("%s=%d started PostgreSQL %d", PGVersionEnv, want, got)
	}
}
