package throwaway

import (
	"slices"
	"testing"
)

// Close must stop later things before the earlier ones they may depend on
// (a relay before its database), skip what its owner already stopped, and
// leave nothing to run twice.
func TestServicesCloseRunsNewestFirstOnce(t *testing.T) {
	var s Services
	var ran []string
	s.OnClose(func() { ran = append(ran, "database") })
	removeStopped := s.OnClose(func() { ran = append(ran, "stopped by its owner") })
	s.OnClose(func() { ran = append(ran, "relay") })
	removeStopped()

	s.Close()
	if want := []string{"relay", "database"}; !slices.Equal(ran, want) {
		t.Fatalf("first Close ran %q, want %q", ran, want)
	}

	ran = nil
	s.OnClose(func() { ran = append(ran, "added after Close") })
	s.Close()
	if want := []string{"added after Close"}; !slices.Equal(ran, want) {
		t.Fatalf("second Close ran %q, want %q", ran, want)
	}
}
