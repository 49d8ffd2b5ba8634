package pipeline

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/backoff"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/sink"
)

// Source is a source's side of the restart loop.
type Source interface {
	// Session runs one session, with producers that build batches of at
	// most batchLimit bytes, until a failure or ctx ends. ran says it got
	// to its running state.
	Session(ctx context.Context, batchLimit int) (ran bool, err error)
	// Fatal reports whether err, besides the errors fatal to every source
	// (IsFatal), needs the operator. It may return err with more to say.
	Fatal(err error) (error, bool)
	// Waiting is called once for each failed session, in order. It names
	// the state the error leaves the source waiting in (a held slot, a
	// standby) and what to log when the wait begins; "" for a failure.
	Waiting(err error) (State, string)
	// FailureMessage is what to log when a session failed; ran says it
	// got to its running state.
	FailureMessage(ran bool) string
	// SetState records a state and the error that led to it.
	SetState(state State, err error)
}

// What a source does with an event the sink will never accept, chosen by
// --on-permanent-error: keep it in the quarantine table and go on, or stop.
const (
	OnPermanentQuarantine = "quarantine"
	OnPermanentHalt       = "halt"
)

// ValidateOnPermanent refuses a policy that is neither.
func ValidateOnPermanent(policy string) error {
	if policy != OnPermanentQuarantine && policy != OnPermanentHalt {
		return fmt.Errorf("--on-permanent-error %q: use quarantine or halt", policy)
	}
	return nil
}

// IsFatal reports whether err needs the operator whatever the source:
// retrying cannot fix it.
func IsFatal(err error) bool {
	return errors.Is(err, pg.ErrPrecondition) || errors.Is(err, sink.ErrAuth) || errors.Is(err, ErrQuarantineWrite) ||
		errors.Is(err, sink.ErrTopicPartitions)
}

// maxWaitPoll caps the delay while waiting as a standby: often enough to
// take over within seconds.
const maxWaitPoll = 2 * time.Second

// Restarts runs a source's sessions until ctx ends or a fatal error: after
// a failure, it backs off with jitter and starts a new session.
type Restarts struct {
	Source  Source
	Log     zerolog.Logger
	Clock   Clock
	Metrics *Metrics
	// BackoffMin and BackoffMax bound the delay before a new session.
	BackoffMin, BackoffMax time.Duration
	// ResetAfter: a session that lasted this long, like one that ran,
	// ended an outage, so the next failure starts from BackoffMin.
	ResetAfter time.Duration
	// BatchLimit is the batch limit of the first session's producers.
	BatchLimit int
	// Alive, when set, is told every second of a wait, for a watchdog
	// that watches the source and nothing else.
	Alive func()
}

// Run runs sessions until ctx ends (nil) or a fatal error (returned).
func (l *Restarts) Run(ctx context.Context) error {
	attempt := 0
	// waiting is the waiting state last logged at info level: one line
	// per wait, not one per poll.
	var waiting State
	batchLimit := l.BatchLimit
	for {
		started := l.Clock.Now()
		ran, err := l.Source.Session(ctx, batchLimit)
		if ctx.Err() != nil {
			l.Source.SetState(StateStopped, nil)
			return nil
		}
		err, fatal := l.Source.Fatal(err)
		if fatal || IsFatal(err) {
			l.Source.SetState(StateFailed, err)
			return err
		}
		var limit *sink.BatchLimitError
		if errors.As(err, &limit) {
			// Not a failure: a topic takes smaller batches than the
			// producer builds. Every later producer builds smaller ones.
			batchLimit = min(batchLimit, limit.MaxMessageBytes)
			l.Log.Warn().Str("topic", limit.Topic).Int("max_message_bytes", limit.MaxMessageBytes).
				Msg("topic takes smaller batches than the producer builds; restarting the producer with the topic's limit")
			attempt = 0
			continue
		}
		// A session that ran ended an outage: the next one is a new
		// outage and starts from the shortest delay. Counting on across
		// them made three restarts 7 s apart wait 1.6, 3.2 and 7.6 s.
		if ran || l.Clock.Now().Sub(started) > l.ResetAfter {
			attempt = 0
		}
		attempt++
		wait := backoff.Delay(l.BackoffMin, l.BackoffMax, attempt)
		if state, msg := l.Source.Waiting(err); state != "" {
			wait = backoff.Delay(l.BackoffMin, min(l.BackoffMax, maxWaitPoll), attempt)
			ev := l.Log.Debug()
			if waiting != state {
				ev = l.Log.Info()
			}
			waiting = state
			l.Source.SetState(state, err)
			ev.Err(err).Str("retry_in", wait.String()).Msg(msg)
		} else {
			waiting = ""
			l.Source.SetState(StateBackingOff, err)
			l.Metrics.Restarts.Inc()
			l.Log.Warn().Str("error", sink.Explain(err)).Str("retry_in", wait.String()).Int("attempt", attempt).
				Msg(l.Source.FailureMessage(ran))
		}
		if !l.sleep(ctx, wait) {
			l.Source.SetState(StateStopped, nil)
			return nil
		}
	}
}

// sleep waits d, telling Alive every second if set; false when ctx ended
// first.
func (l *Restarts) sleep(ctx context.Context, d time.Duration) bool {
	t := l.Clock.NewTimer(d)
	defer t.Stop()
	var tick <-chan time.Time // nil without Alive: never ticks
	var alive Timer
	if l.Alive != nil {
		alive = l.Clock.NewTimer(time.Second)
		defer alive.Stop()
		tick = alive.C()
	}
	for {
		if l.Alive != nil {
			l.Alive()
		}
		select {
		case <-t.C():
			return true
		case <-tick:
			alive.Reset(time.Second)
		case <-ctx.Done():
			return false
		}
	}
}
