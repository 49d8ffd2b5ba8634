package relay

import (
	"errors"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Status is the relay's own view, for the admin endpoint.
type Status struct {
	pipeline.Status

	ReceivedLSN           string     `json:"received_lsn"`
	ConfirmedLSN          string     `json:"confirmed_lsn"`
	InFlightEvents        int        `json:"in_flight_events"`
	InFlightTxns          int        `json:"in_flight_transactions"`
	OldestInFlightSeconds float64    `json:"oldest_in_flight_age_seconds"`
	LastConfirmedCommit   *time.Time `json:"last_confirmed_commit_time"`
	LastAck               *time.Time `json:"last_ack_time"`
	QuarantinedEvents     int64      `json:"quarantined_events"`
	// Progress is the position kept in Kafka and where the last start began.
	Progress *ProgressStatus `json:"progress,omitempty"`
	// Delivery is the delivery mode and, in exactly-once mode, what the
	// Kafka transactions did.
	Delivery *DeliveryStatus `json:"delivery"`

	tracker *lsn.Tracker
	// lastErrorBusy says LastError is the slot being held by another
	// process, which explains only the wait for it.
	lastErrorBusy bool
	// streamed is set once a session of this process streamed: from then
	// on a missing slot means lost events, not a first start.
	streamed bool
}

// slotReading is the slot watch's last reading, served by /slot.
type slotReading struct {
	info  *replication.SlotInfo
	err   string // redacted; "" when the read worked
	at    time.Time
	guard *guardReading // nil when the slot could not be read
}

func (r *Relay) setState(state pipeline.State, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.status.Set(state, err, time.Now())
	r.metrics.SetState(state)
	if err != nil {
		r.status.lastErrorBusy = errors.Is(err, replication.ErrSlotBusy)
	}
	if state != pipeline.StateStreaming && state != pipeline.StateDraining {
		r.status.tracker = nil
	}
}

// setDetail says how far the current state has come.
func (r *Relay) setDetail(detail string) {
	r.mu.Lock()
	r.status.Detail = detail
	r.mu.Unlock()
}

func (r *Relay) setStreaming(t *lsn.Tracker) {
	r.mu.Lock()
	r.status.tracker = t
	r.status.streamed = true
	r.mu.Unlock()
	r.report.start()
	r.setState(pipeline.StateStreaming, nil)
}

// slotView is what the slot watch found: its last reading of the slot,
// the quarantine table's count, and what the readings say of the slot's
// position (the newest moment before which every committed transaction is
// confirmed, and whether the last good reading found the slot behind the
// WAL end). The slot watch writes it; the WAL reader and the status read
// it.
type slotView struct {
	mu          sync.Mutex
	reading     slotReading
	quarantined int64
	caughtUp    time.Time
	behind      bool
	started     time.Time // when the slot watch began
}

// noteReading keeps the slot watch's last reading, for /slot.
func (p *slotView) noteReading(reading slotReading) {
	p.mu.Lock()
	p.reading = reading
	p.mu.Unlock()
}

// lastReading is the slot watch's last reading.
func (p *slotView) lastReading() slotReading {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.reading
}

// noteQuarantined keeps the quarantine table's count.
func (p *slotView) noteQuarantined(n int64) {
	p.mu.Lock()
	p.quarantined = n
	p.mu.Unlock()
}

// quarantinedEvents is the quarantine table's last count.
func (p *slotView) quarantinedEvents() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.quarantined
}

// watching records when the slot watch began.
func (p *slotView) watching(since time.Time) {
	p.mu.Lock()
	p.started = since
	p.mu.Unlock()
}

// note keeps a reading's conclusion.
func (p *slotView) note(caughtUp time.Time, behind bool) {
	p.mu.Lock()
	p.caughtUp, p.behind = caughtUp, behind
	p.mu.Unlock()
}

// unpublishedAge is outbox_relay_oldest_unpublished_event_age_seconds,
// given inFlight, the age of the oldest event in flight. While the read
// loop reads the stream it is that age: events arrive within moments of
// their commit. Outside the stream (waiting for Kafka, draining,
// restarting) the relay sees none of the events committed meanwhile, so
// when the slot watch's last good reading found the slot behind the
// server's WAL end, the age is the time since the newest moment before
// which everything committed is known confirmed: the later of the slot
// watch's caught-up moment and confirmedCommit, the commit time of the
// newest transaction this process confirmed (or, with neither, when the
// watch began, which may understate); never less than inFlight. That is
// an upper bound: other tables' WAL also puts the slot behind, and an idle
// outbox in a busy database shows the time since the slot last caught up.
// A nil position knows nothing beyond inFlight.
func (p *slotView) unpublishedAge(now time.Time, inFlight float64, reading bool, confirmedCommit time.Time) float64 {
	if p == nil {
		return inFlight
	}
	p.mu.Lock()
	caughtUp, behind, started := p.caughtUp, p.behind, p.started
	p.mu.Unlock()
	if reading || !behind {
		return inFlight
	}
	anchor := later(caughtUp, confirmedCommit)
	if anchor.IsZero() {
		anchor = started
	}
	return max(inFlight, now.Sub(anchor).Seconds())
}

// streamState is what the slot watch reads of the stream at now: the
// events in flight, and the age of the oldest unpublished event as the
// relay's state says it (see slotView.unpublishedAge). One look at the
// state and the tracker serves both.
func (r *Relay) streamState(now time.Time) (inFlight int, unpublishedAge float64) {
	s, read := r.current()
	var oldestAge float64
	if s.tracker != nil {
		st := s.tracker.Stats()
		inFlight = st.InFlightEvents
		if !st.OldestInFlight.IsZero() {
			oldestAge = now.Sub(st.OldestInFlight).Seconds()
		}
	}
	// A stalled loop still reads; a paused or draining one does not.
	reading := (s.State == pipeline.StateStreaming || s.State == pipeline.StateWaitingForKafka) && !read.paused
	return inFlight, r.slot.unpublishedAge(now, oldestAge, reading, read.confirmedCommit)
}

// current is the relay's status as set here, with what the WAL reader
// reports applied to it: a loop that drains makes a streaming relay a
// draining one, and a loop that waits for Kafka (paused, or stalled past
// --kafka-stall-timeout) a waiting-for-kafka one with the cause as its
// last error, so /slot, /readyz and the log say the same.
func (r *Relay) current() (Status, readSnapshot) {
	r.mu.Lock()
	s := r.status
	r.mu.Unlock()
	read := r.report.snapshot()
	if s.State != pipeline.StateStreaming {
		return s, read
	}
	switch {
	case !read.draining.IsZero():
		s.State, s.Since = pipeline.StateDraining, read.draining
	case read.paused:
		s.State, s.Since = pipeline.StateWaitingForKafka, read.pausedAt
		if read.kafkaErr != "" {
			s.SetError("kafka failed; the relay keeps the replication connection until a producer connects again: "+read.kafkaErr, read.pausedAt)
		}
	default:
		now := time.Now()
		if reason, since := r.stallReason(s, read, now); reason != "" {
			s.State, s.Since = pipeline.StateWaitingForKafka, since
			s.SetError(reason, since)
		}
	}
	return s, read
}

// later is the later of two times.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// confirmedCommitTime is the commit time of the newest transaction whose
// events Kafka acknowledged and the relay confirmed.
func (r *Relay) confirmedCommitTime() time.Time {
	return r.report.snapshot().confirmedCommit
}

// Status returns a snapshot of the relay's state.
func (r *Relay) Status() Status {
	s, read := r.current()
	s.Delivery = r.delivery.status()
	if received := read.received; received != 0 {
		s.ReceivedLSN = received.String()
	}
	if s.tracker != nil {
		st := s.tracker.Stats()
		s.ConfirmedLSN = st.Confirmed.String()
		s.InFlightEvents = st.InFlightEvents
		s.InFlightTxns = st.InFlightTxns
		if !st.OldestInFlight.IsZero() {
			s.OldestInFlightSeconds = time.Since(st.OldestInFlight).Seconds()
		}
		if !st.ConfirmedCommitTime.IsZero() {
			t := st.ConfirmedCommitTime
			s.LastConfirmedCommit = &t
		}
	}
	if last := r.report.lastAck.get(); !last.IsZero() {
		s.LastAck = &last
	}
	s.Progress = r.progress.status()
	s.QuarantinedEvents = r.slot.quarantinedEvents()
	return s
}

// Ready reports whether the relay is streaming with Kafka acknowledging,
// and why not.
func (r *Relay) Ready() (bool, string) {
	s := r.Status()
	if s.State == pipeline.StateStreaming {
		return true, ""
	}
	reason := string(s.State)
	// "slot in use by PID ..." explains only the wait for the slot: once
	// the relay moved on (connecting, say), it would name a process that
	// is gone. /slot keeps it as last_error.
	r.mu.Lock()
	busy := r.status.lastErrorBusy
	r.mu.Unlock()
	if s.LastError != "" && (!busy || s.State == pipeline.StateWaitingForSlot) {
		reason += ": " + s.LastError
	}
	return false, reason
}
