package pipeline

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/sink"
)

// scripted is a source whose sessions end as its script says; the last
// session ends the test's context.
type scripted struct {
	script  []error
	ran     []bool
	limits  []int
	states  []State
	cancel  context.CancelFunc
	waiting State
}

func (s *scripted) Session(_ context.Context, limit int) (bool, error) {
	s.limits = append(s.limits, limit)
	i := len(s.limits) - 1
	if i == len(s.script)-1 {
		s.cancel()
	}
	return s.ran[i], s.script[i]
}

func (s *scripted) Fatal(err error) (error, bool) { return err, false }

func (s *scripted) Waiting(err error) (State, string) {
	if errors.Is(err, errHeld) {
		return s.waiting, "held"
	}
	return "", ""
}

func (s *scripted) FailureMessage(bool) string { return "failed" }

func (s *scripted) SetState(state State, _ error) { s.states = append(s.states, state) }

var errHeld = errors.New("held")

// instant is a clock whose timers fire at once and record their delays.
type instant struct{ delays *[]time.Duration }

func (c instant) Now() time.Time { return time.Unix(0, 0) }

func (c instant) NewTimer(d time.Duration) Timer {
	*c.delays = append(*c.delays, d)
	ch := make(chan time.Time, 1)
	ch <- time.Unix(0, 0)
	return instantTimer(ch)
}

type instantTimer chan time.Time

func (t instantTimer) C() <-chan time.Time { return t }
func (instantTimer) Reset(time.Duration)   {}
func (instantTimer) Stop()                 {}

func TestRestartsShrinksTheBatchLimitWaitsAndCountsFailures(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	src := &scripted{cancel: cancel, waiting: StateWaitingForSlot,
		script: []error{&sink.BatchLimitError{Topic: "t", MaxMessageBytes: 1000}, errHeld, errors.New("kafka down"), nil},
		ran:    []bool{false, false, false, false}}
	var delays []time.Duration
	m := NewMetrics(nil)
	loop := Restarts{Source: src, Log: zerolog.Nop(), Clock: instant{&delays}, Metrics: m,
		BackoffMin: time.Second, BackoffMax: time.Minute, ResetAfter: time.Minute, BatchLimit: 5000}
	if err := loop.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(src.limits) != "[5000 1000 1000 1000]" {
		t.Errorf("batch limits %v: the smaller limit must hold from the session after it", src.limits)
	}
	want := []State{StateWaitingForSlot, StateBackingOff, StateStopped}
	if fmt.Sprint(src.states) != fmt.Sprint(want) {
		t.Errorf("states %v, want %v", src.states, want)
	}
	if len(delays) != 2 || delays[0] > maxWaitPoll {
		t.Errorf("delays %v: a wait polls within %v, a failure backs off", delays, maxWaitPoll)
	}
}

func TestRestartsStopsOnAFatalError(t *testing.T) {
	src := &scripted{cancel: func() {}, script: []error{fmt.Errorf("write: %w", ErrQuarantineWrite), nil}, ran: []bool{true, false}}
	var delays []time.Duration
	loop := Restarts{Source: src, Log: zerolog.Nop(), Clock: instant{&delays}, Metrics: NewMetrics(nil),
		BackoffMin: time.Second, BackoffMax: time.Minute, BatchLimit: 1}
	if err := loop.Run(context.Background()); !errors.Is(err, ErrQuarantineWrite) {
		t.Fatalf("Run: %v, want the quarantine write error", err)
	}
	if fmt.Sprint(src.states) != fmt.Sprint([]State{StateFailed}) || len(delays) != 0 {
		t.Errorf("states %v, delays %v: a fatal error fails at once", src.states, delays)
	}
}
