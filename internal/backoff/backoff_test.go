package backoff

import (
	"testing"
	"time"
)

func TestDelayDoublesWithinJitterAndCaps(t *testing.T) {
	const lo, hi = 100 * time.Millisecond, 5 * time.Second
	for _, c := range []struct {
		attempt int
		full    time.Duration
	}{
		{0, lo}, {1, lo}, {2, 2 * lo}, {4, 8 * lo}, {7, hi}, {100, hi},
	} {
		for range 50 {
			d := Delay(lo, hi, c.attempt)
			if d < c.full/2 || d > c.full {
				t.Fatalf("attempt %d: %v, want within [%v, %v]", c.attempt, d, c.full/2, c.full)
			}
		}
	}
}

func TestDelayOverflowFallsBackToCap(t *testing.T) {
	// A shift that overflows to a negative duration must not return less
	// than the cap's lower half.
	if d := Delay(time.Hour, 2*time.Hour, 40); d < time.Hour || d > 2*time.Hour {
		t.Fatalf("got %v, want within [1h, 2h]", d)
	}
}
