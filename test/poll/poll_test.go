package poll_test

import (
	"testing"
	"time"
)

// The basic promise: every committed event arrives once, in per-aggregate
// order, and its row is marked published.
func TestPollDeliversEveryEventInOrder(t *testing.T) {
	e := newEnv(t)
	conn := e.db.Connect(t)
	e.writeEvents(conn, 50, 4, 7) // before the poller: a backlog
	p := e.startPoller()
	e.writeEvents(conn, 50, 4, 7) // while it polls: woken by NOTIFY
	records := e.consumeAll(time.Minute)
	if len(records) != e.CommittedCount() {
		t.Errorf("%d records for %d events: a poller alone on a table must publish each once", len(records), e.CommittedCount())
	}
	if code, err := p.Stop(30 * time.Second); err != nil || code != 0 {
		t.Fatalf("poller stopped with %d, %v:\n%s", code, err, p.Output())
	}
	if n := e.unpublished(); n != 0 {
		t.Errorf("%d state rows still unpublished after every event arrived", n)
	}
}
