package pipeline

import "time"

// Clock is a source's time: the wall clock in production, a fake one in
// tests so that restart and status timing are asserted exactly.
type Clock interface {
	Now() time.Time
	NewTimer(d time.Duration) Timer
}

// Timer is the part of *time.Timer the loops use.
type Timer interface {
	C() <-chan time.Time
	// Reset stops the timer, drops a tick not yet read, and starts it anew.
	Reset(d time.Duration)
	Stop()
}

// WallClock is the clock of a running source.
type WallClock struct{}

func (WallClock) Now() time.Time { return time.Now() }

func (WallClock) NewTimer(d time.Duration) Timer { return wallTimer{time.NewTimer(d)} }

type wallTimer struct{ t *time.Timer }

func (w wallTimer) C() <-chan time.Time { return w.t.C }

// Since Go 1.23 Reset and Stop leave no stale tick in the channel.
func (w wallTimer) Reset(d time.Duration) { w.t.Reset(d) }
func (w wallTimer) Stop()                 { w.t.Stop() }
