// Package backoff computes capped exponential delays with jitter. It is
// shared by the restart loop of every source and the publisher's retries so both
// back off the same way; it sits below both so neither reaches into the
// other.
package backoff

import (
	"math/rand/v2"
	"time"
)

// Delay returns the wait before try number attempt (1 for the first retry):
// lo doubled per attempt, capped at hi, then drawn uniformly from the upper
// half so that many clients retrying together spread out.
func Delay(lo, hi time.Duration, attempt int) time.Duration {
	d := lo << min(max(attempt-1, 0), 16)
	if d <= 0 || d > hi {
		d = hi
	}
	return d/2 + rand.N(d/2+1)
}
