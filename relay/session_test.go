package relay

import (
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// The read loop's wake-up decides how long a confirmable position can sit
// unreported: these cases pin each reason to wake.
func TestNextWake(t *testing.T) {
	const keepalive, statusInterval = 10 * time.Second, 3 * time.Second
	relay := &Relay{cfg: Config{StatusInterval: statusInterval}}
	newStreamer := func(lastStatus time.Time) (*streamer, *lsn.Tracker) {
		tr := lsn.NewTracker(100, lsn.Limits{Events: 10, Bytes: 1 << 20})
		return &streamer{relay: relay, tracker: tr, lastStatus: lastStatus, flushedSent: 100, keepaliveEvery: keepalive}, tr
	}
	near := func(t *testing.T, got, want time.Time) {
		t.Helper()
		// nextWake reads the clock itself; a test machine's pause is allowed
		// for, the heartbeat (3 s) or a keepalive (10 s) is not.
		if d := got.Sub(want); d < -400*time.Millisecond || d > 400*time.Millisecond {
			t.Fatalf("wake at %v, want about %v (off by %v)", got.Format(time.StampMilli), want.Format(time.StampMilli), d)
		}
	}

	t.Run("nothing to report: the heartbeat", func(t *testing.T) {
		s, _ := newStreamer(time.Now())
		near(t, s.nextWake(), time.Now().Add(statusInterval))
	})
	t.Run("nothing to report, keepalive due first", func(t *testing.T) {
		last := time.Now().Add(-9 * time.Second)
		s, _ := newStreamer(last)
		near(t, s.nextWake(), last.Add(keepalive))
	})
	t.Run("acks pending: look again soon", func(t *testing.T) {
		s, tr := newStreamer(time.Now())
		id := tr.Open(time.Now())
		tr.Add(id, 10)
		near(t, s.nextWake(), time.Now().Add(idleConfirmDelay))
	})
	t.Run("idle with a moved position: due shortly after the last update", func(t *testing.T) {
		// The last update went out 50 ms ago, then the last ack came: the
		// moved position must go out 50 ms from now, not a status interval
		// or a keepalive later.
		last := time.Now().Add(-50 * time.Millisecond)
		s, tr := newStreamer(last)
		id := tr.Open(time.Now())
		tr.Add(id, 10)
		tr.Close(id, 200)
		tr.Ack(id, 10)
		if !tr.Idle() || tr.Confirmed() != 200 {
			t.Fatalf("tracker: idle %t, confirmed %v; want idle at 200", tr.Idle(), tr.Confirmed())
		}
		near(t, s.nextWake(), last.Add(idleConfirmDelay))
	})
}
