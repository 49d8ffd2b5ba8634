package pipeline

import (
	"errors"
	"time"
)

// State names what a source is doing. All sources share the one set, so
// outbox_relay_state has one label set and /readyz one rule.
type State string

// The states shown by the admin endpoint and outbox_relay_state.
const (
	StateStarting   State = "starting"
	StateConnecting State = "connecting"
	// StateStreaming is the running state of the WAL path and the
	// messages source.
	StateStreaming State = "streaming"
	// StatePolling is poll mode's running state.
	StatePolling        State = "polling"
	StateWaitingForSlot State = "waiting-for-slot"
	// StateWaitingForLock: poll mode's snapshot strategy waits, as a
	// standby, for the poller that holds the table's lock.
	StateWaitingForLock State = "waiting-for-lock"
	// StateWaitingForPromotion: --pg-dsn leads to a hot standby, which
	// cannot serve the relay's slot until it is promoted.
	StateWaitingForPromotion State = "waiting-for-promotion"
	// StateWaitingForKafka: the WAL path holds its replication
	// connection while Kafka is unreachable or acknowledges nothing for
	// longer than --kafka-stall-timeout; nothing is read meanwhile, or
	// what was sent waits for its ack.
	StateWaitingForKafka State = "waiting-for-kafka"
	// StateRecovering: the WAL path makes a new slot and republishes,
	// from the outbox table, what Kafka lacks of what the old one (or no
	// slot) left behind; Status.Detail says how far it is.
	StateRecovering State = "recovering"
	StateBackingOff State = "backing-off"
	StateDraining   State = "draining"
	StateStopped    State = "stopped"
	StateFailed     State = "failed"
)

// States are every source's states.
var States = []State{StateStarting, StateConnecting, StateStreaming, StatePolling, StateWaitingForSlot,
	StateWaitingForLock, StateWaitingForPromotion, StateWaitingForKafka, StateRecovering, StateBackingOff, StateDraining, StateStopped, StateFailed}

// Status is what every source says of its state; a source's own document
// embeds it.
type Status struct {
	State State `json:"state"`
	// LastError is the most recent error, kept after recovery;
	// LastErrorAt says when it happened, so an old one is not taken for
	// the cause of the state now.
	LastError   string     `json:"last_error"`
	LastErrorAt *time.Time `json:"last_error_at,omitempty"`
	Since       time.Time  `json:"state_since"`
	// Detail says how far a long state has come (recovering: the phase
	// and the rows done); empty otherwise.
	Detail string `json:"detail,omitempty"`
}

// Set moves to state at now; a non-nil err becomes LastError.
func (s *Status) Set(state State, err error, now time.Time) {
	if s.State != state {
		s.Since = now
		s.Detail = ""
	}
	s.State = state
	if err != nil {
		s.SetError(err.Error(), now)
	}
}

// SetError records the most recent error, at.
func (s *Status) SetError(err string, at time.Time) {
	s.LastError, s.LastErrorAt = err, &at
}

// NotReady is /readyz's reason for a state that is not the running one.
func (s Status) NotReady() string {
	reason := string(s.State)
	if s.LastError != "" {
		reason += ": " + s.LastError
	}
	return reason
}

// ErrQuarantineWrite marks a failed write to the quarantine table. Retrying
// would fail the same way on the same event and hold it back for ever, so
// the source stops and says what to fix.
var ErrQuarantineWrite = errors.New("could not write to the quarantine table")

// Hooks let the process around a source react to its progress (systemd
// readiness and watchdog). Each may be nil.
type Hooks struct {
	// Running is called each time a session reaches the running state.
	Running func()
	// Alive is called while the source's loops turn: at least once per
	// status or poll interval while it runs.
	Alive func()
}
