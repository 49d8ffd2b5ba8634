package relay

import (
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/tcpdial"
)

// ErrServerSilent ends a session whose replication connection brought
// nothing although the relay asked the server to answer: the connection is
// taken for dead and made again. Without it a connection whose peer
// vanished without closing it (a NAT or load balancer that dropped its
// state, a proxy whose upstream hangs) kept the relay waiting for ever,
// alive and publishing nothing.
var ErrServerSilent = errors.New("replication connection silent")

// liveness tells a live replication connection from a dead one. The server
// answers a status update that asks for a reply with a keepalive at once,
// so a relay that has asked twice and heard nothing for deadAfter has lost
// the connection, whatever TCP says.
type liveness struct {
	deadAfter time.Duration
	// pgTimeout and senderTimeout are what deadAfter came from, for the
	// message.
	pgTimeout, senderTimeout time.Duration
	pingEvery                time.Duration
	lastPing                 time.Time
	// pings counts the requests for an answer since heardAt, the last
	// arrival seen.
	pings   int
	heardAt time.Time
}

// newLiveness bounds the silence by --pg-timeout, and never by less than
// wal_sender_timeout: a walsender busy decoding a large transaction it
// filters out answers only at its own keepalive, every half of that.
func newLiveness(pgTimeout, senderTimeout, keepaliveEvery time.Duration) liveness {
	if pgTimeout <= 0 {
		pgTimeout = tcpdial.DefaultDeadAfter
	}
	dead := max(pgTimeout, senderTimeout)
	return liveness{deadAfter: dead, pgTimeout: pgTimeout, senderTimeout: senderTimeout, pingEvery: min(keepaliveEvery, dead/3)}
}

func (l *liveness) heard(at time.Time) {
	if at.After(l.heardAt) {
		l.heardAt, l.pings = at, 0
	}
}

// ping says whether the next status update should ask for an answer: the
// server has been silent for pingEvery, and the last request is as old.
func (l *liveness) ping(now, heard time.Time) bool {
	l.heard(heard)
	return now.Sub(heard) >= l.pingEvery && now.Sub(l.lastPing) >= l.pingEvery
}

func (l *liveness) pinged(now time.Time) {
	l.lastPing = now
	l.pings++
}

// check is asked when a read waited and nothing came.
func (l *liveness) check(now, heard time.Time) error {
	l.heard(heard)
	silent := now.Sub(heard)
	if silent < l.deadAfter || l.pings < 2 {
		return nil
	}
	return fmt.Errorf("%w: nothing from the server for %s although the relay asked it to answer %d times; "+
		"taking the connection for dead (a NAT, load balancer or firewall that dropped it, or a failed host) and connecting again "+
		"(the wait is bounded by %s: the longer of --pg-timeout %s and the server's wal_sender_timeout %s)",
		ErrServerSilent, silent.Round(time.Second), l.pings, l.deadAfter, l.pgTimeout, l.senderTimeout)
}
