package relay

import (
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// The read loop's wake-up decides how long a confirmable position can sit
// unreported: these cases pin each reason to wake, exactly, on a fake clock.
func TestNextWake(t *testing.T) {
	const keepalive, statusInterval = 10 * time.Second, 3 * time.Second
	cfg := loopConfig{statusInterval: statusInterval}
	newReadLoop := func(sinceStatus time.Duration) (*walReader, *lsn.Tracker, *fakeClock) {
		clk := newFakeClock()
		tr := lsn.NewTracker(100, lsn.Limits{Events: 10, Bytes: 1 << 20})
		tr.UseClock(clk.Now)
		last := clk.Now().Add(-sinceStatus)
		return &walReader{loopEnv: loopEnv{cfg: cfg, clock: clk}, tracker: tr, lastStatus: last, flushedSent: 100, keepaliveEvery: keepalive}, tr, clk
	}
	exactly := func(t *testing.T, got, want time.Time) {
		t.Helper()
		if !got.Equal(want) {
			t.Fatalf("wake at %v, want %v (off by %v)", got.Format(time.StampMilli), want.Format(time.StampMilli), got.Sub(want))
		}
	}

	t.Run("nothing to report: the heartbeat", func(t *testing.T) {
		s, _, clk := newReadLoop(0)
		exactly(t, s.Wake(), clk.Now().Add(statusInterval))
	})
	t.Run("nothing to report, keepalive due first", func(t *testing.T) {
		s, _, clk := newReadLoop(9 * time.Second)
		exactly(t, s.Wake(), clk.Now().Add(time.Second))
	})
	t.Run("acks pending: look again soon", func(t *testing.T) {
		s, tr, clk := newReadLoop(0)
		id := tr.Open(clk.Now())
		tr.Add(id, 10)
		exactly(t, s.Wake(), clk.Now().Add(idleConfirmDelay))
	})
	t.Run("idle with a moved position: due shortly after the last update", func(t *testing.T) {
		// The last update went out 50 ms ago, then the last ack came: the
		// moved position must go out 50 ms from now, not a status interval
		// or a keepalive later.
		s, tr, clk := newReadLoop(50 * time.Millisecond)
		id := tr.Open(clk.Now())
		tr.Add(id, 10)
		tr.Close(id, 200)
		tr.Ack(id, 10)
		if !tr.Idle() || tr.Confirmed() != 200 {
			t.Fatalf("tracker: idle %t, confirmed %v; want idle at 200", tr.Idle(), tr.Confirmed())
		}
		exactly(t, s.Wake(), clk.Now().Add(50*time.Millisecond))
	})
}
