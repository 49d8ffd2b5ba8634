package relay

import (
	"errors"
	"testing"
	"time"
)

// A replication connection whose server stops answering (black-holed in
// the network: no FIN, no RST) ends the session once the server was asked
// to answer and stayed silent for the bound; while it answers its pings,
// an idle stream goes on for ever.
func TestLoopTakesASilentServerForDead(t *testing.T) {
	rig := startLoop(t, rigOptions{})
	t0 := rig.clock.Now()
	bound := newLiveness(0, 0, rigKeepalive).deadAfter
	for rig.clock.Now().Sub(t0) < 3*bound {
		rig.source.idle(t)
	}
	select {
	case err := <-rig.done:
		t.Fatalf("a server that answers its pings was taken for dead: %v", err)
	default:
	}

	rig.source.silent.Store(true)
	silentFrom := rig.clock.Now()
	err := rig.untilEnd(t)
	if !errors.Is(err, ErrServerSilent) {
		t.Fatalf("session ended with %v, want ErrServerSilent", err)
	}
	took := rig.clock.Now().Sub(silentFrom)
	if took < bound-rigKeepalive || took > bound+rigKeepalive {
		t.Fatalf("the silence was noticed after %v, want about %v", took, bound)
	}
}

// The bound is --pg-timeout, never shorter than wal_sender_timeout (a
// walsender decoding a large filtered transaction answers only at its own
// keepalive), and the pings come at least three times inside it.
func TestLivenessBound(t *testing.T) {
	for _, c := range []struct {
		pg, sender, keepalive, dead, ping time.Duration
	}{
		{0, 60 * time.Second, 10 * time.Second, 60 * time.Second, 10 * time.Second},
		{30 * time.Second, 0, 10 * time.Second, 30 * time.Second, 10 * time.Second},
		{90 * time.Second, 60 * time.Second, 10 * time.Second, 90 * time.Second, 10 * time.Second},
		{3 * time.Second, 0, 10 * time.Second, 3 * time.Second, time.Second},
	} {
		l := newLiveness(c.pg, c.sender, c.keepalive)
		if l.deadAfter != c.dead || l.pingEvery != c.ping {
			t.Errorf("newLiveness(%v, %v, %v) = dead after %v, ping every %v; want %v, %v",
				c.pg, c.sender, c.keepalive, l.deadAfter, l.pingEvery, c.dead, c.ping)
		}
	}
}
