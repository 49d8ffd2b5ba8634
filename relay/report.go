package relay

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// readReport is what the WAL reader publishes about its reading: the
// position read, the newest commit confirmed, whether it waits for Kafka,
// and the last ack. The loop of the running session is its one writer,
// on its own goroutine (a session marks it reading again before its loop
// starts); the admin endpoint, the stall watch, retention and the slot
// poller's age only read it. It outlives sessions: retention and /slot
// keep the newest confirmed commit and the last ack across a restart.
type readReport struct {
	// lastAck is an atomic so that an ack, the hottest report, takes no
	// lock.
	lastAck ackClock

	mu              sync.Mutex
	received        lsn.LSN
	confirmedCommit time.Time
	// paused says the engine waits for Kafka and reads nothing: the
	// tracker then knows nothing of the events committed meanwhile.
	paused bool
	// pausedAt is when the wait began, and kafkaErr the failure that
	// began it, so /slot says why the relay is not ready.
	pausedAt time.Time
	kafkaErr string
	// draining is when the loop began its drain on shutdown; zero while
	// it reads.
	draining time.Time
}

// readSnapshot is a copy of a readReport's position.
type readSnapshot struct {
	received        lsn.LSN
	confirmedCommit time.Time
	paused          bool
	pausedAt        time.Time
	kafkaErr        string
	draining        time.Time
}

// acked records an ack; a nil report (a loop built without a relay, as in
// tests) records nothing.
func (p *readReport) acked(at time.Time) {
	if p != nil {
		p.lastAck.note(at)
	}
}

// position records what was read and, when it moved, the commit time of
// the newest transaction confirmed.
func (p *readReport) position(received lsn.LSN, confirmedCommit time.Time) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.received = received
	p.confirmedCommit = later(p.confirmedCommit, confirmedCommit)
	p.mu.Unlock()
}

// start records that a new session's loop reads: neither paused nor
// draining.
func (p *readReport) start() {
	p.mu.Lock()
	p.paused, p.draining = false, time.Time{}
	p.mu.Unlock()
}

// drain records that the loop stopped reading to drain, at now.
func (p *readReport) drain(now time.Time) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.draining = now
	p.mu.Unlock()
}

// pause records that the loop stopped reading at now to wait for Kafka,
// which failed with cause.
func (p *readReport) pause(now time.Time, cause error) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.paused, p.pausedAt, p.kafkaErr = true, now, ""
	if cause != nil {
		p.kafkaErr = cause.Error()
	}
	p.mu.Unlock()
}

func (p *readReport) snapshot() readSnapshot {
	p.mu.Lock()
	defer p.mu.Unlock()
	return readSnapshot{received: p.received, confirmedCommit: p.confirmedCommit, paused: p.paused, pausedAt: p.pausedAt,
		kafkaErr: p.kafkaErr, draining: p.draining}
}

// ackClock is when Kafka last acknowledged an event of this process.
type ackClock struct{ ns atomic.Int64 }

func (c *ackClock) note(t time.Time) { c.ns.Store(t.UnixNano()) }

func (c *ackClock) get() time.Time {
	if ns := c.ns.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}
