package engine

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/store"
)

// A quarantine write's bound grows with what it writes, so a 1 MB row
// over a link of 32 KB/s (about 33 s) finishes; and the advice for a write
// that did not finish says so, not only "check that PostgreSQL is up".
func TestQuarantineWriteBoundGrowsWithTheRow(t *testing.T) {
	q := &Quarantiner{timeout: 30 * time.Second}
	small := store.Quarantined{}
	small.EventID = "e"
	if got := q.writeBound(small); got > 31*time.Second {
		t.Errorf("a small row's bound is %v, want about 30s", got)
	}
	big := small
	big.Payload = strings.Repeat("x", 1_000_000)
	bound := q.writeBound(big)
	if over32 := 30*time.Second + time.Duration(1_000_000)*time.Second/(32<<10)*2; bound < over32 {
		t.Errorf("a 1 MB row's bound is %v, want at least %v (the write at 16 KB/s)", bound, over32)
	}
	advice := quarantineAdvice(fmt.Errorf("timeout: %w", context.DeadlineExceeded), &quarantineJob{event: big, bound: bound})
	for _, want := range []string{"did not finish within " + bound.Round(time.Second).String(), "KB/s", "start the relay again"} {
		if !strings.Contains(advice, want) {
			t.Errorf("advice %q does not say %q", advice, want)
		}
	}
}
