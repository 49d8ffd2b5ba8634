package relay

import (
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// State names what the relay is doing.
type State string

// The states shown by the admin endpoint.
const (
	StateStarting       State = "starting"
	StateConnecting     State = "connecting"
	StateStreaming      State = "streaming"
	StateWaitingForSlot State = "waiting-for-slot"
	StateBackingOff     State = "backing-off"
	StateDraining       State = "draining"
	StateStopped        State = "stopped"
	StateFailed         State = "failed"
)

// Status is the relay's own view, for the admin endpoint.
type Status struct {
	State     State     `json:"state"`
	LastError string    `json:"last_error"`
	Since     time.Time `json:"state_since"`

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

	tracker             *lsn.Tracker
	received            lsn.LSN
	confirmedCommitTime time.Time // survives sessions, for retention
}

func (r *Relay) setState(state State, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.status.State != state {
		r.status.Since = time.Now()
	}
	r.status.State = state
	r.metrics.setState(state)
	if err != nil {
		r.status.LastError = err.Error()
	}
	if state != StateStreaming && state != StateDraining {
		r.status.tracker = nil
	}
}

func (r *Relay) setStreaming(t *lsn.Tracker) {
	r.mu.Lock()
	r.status.tracker = t
	r.mu.Unlock()
	r.setState(StateStreaming, nil)
}

func (r *Relay) noteProgress(received lsn.LSN, confirmedCommit time.Time) {
	r.mu.Lock()
	r.status.received = received
	if confirmedCommit.After(r.status.confirmedCommitTime) {
		r.status.confirmedCommitTime = confirmedCommit
	}
	r.mu.Unlock()
}

// confirmedCommitTime is the commit time of the newest transaction whose
// events Kafka acknowledged and the relay confirmed.
func (r *Relay) confirmedCommitTime() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.status.confirmedCommitTime
}

// Status returns a snapshot of the relay's state.
func (r *Relay) Status() Status {
	r.mu.Lock()
	s := r.status
	r.mu.Unlock()
	if s.received != 0 {
		s.ReceivedLSN = s.received.String()
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
	if last := r.metrics.lastAck(); !last.IsZero() {
		s.LastAck = &last
	}
	s.QuarantinedEvents = r.metrics.quarantined()
	s.Progress = r.progressStatus()
	return s
}

// Ready reports whether the relay is streaming, and why not.
func (r *Relay) Ready() (bool, string) {
	s := r.Status()
	if s.State == StateStreaming {
		return true, ""
	}
	reason := string(s.State)
	if s.LastError != "" {
		reason += ": " + s.LastError
	}
	return false, reason
}
