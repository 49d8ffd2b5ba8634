package engine

import (
	"context"
	"errors"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/backoff"
	"github.com/outbox-relay/outbox-relay/sink"
)

// kafkaRecoverable reports whether a session-ending error is Kafka's alone
// and a new producer may fix it, so the source can stay open while Kafka
// is away. A fenced producer is not: a new one would fence the instance
// that now owns the stream.
func (l *Loop) kafkaRecoverable(err error) bool {
	var perr *sink.Error
	return l.cfg.NewSink != nil && errors.As(err, &perr) && perr.Class != sink.ClassPermanent &&
		!errors.Is(err, sink.ErrAuth) && !errors.Is(err, sink.ErrFenced)
}

// waitForKafka keeps the source open through a Kafka outage: it abandons
// the failed sink, keeps the source's duties (a replication connection's
// status, so wal_sender_timeout never fires) and the watchdog without
// reading, and tries a new producer with backoff until one connects. The
// unacknowledged events stay in flight meanwhile, so the age of the oldest
// unpublished event keeps growing and the outage shows in the metrics,
// instead of as a relay stuck connecting with nothing in flight.
//
// The caller then ends the session and reads again from the durable
// position. A replication source cannot do that on the same connection:
// PostgreSQL 15's walsender ends a second START_REPLICATION on a
// connection at once.
func (l *Loop) waitForKafka(ctx context.Context, cause error) error {
	log := l.log
	old := l.sink
	l.abandoned = true
	l.closing.Add(1)
	go func() {
		// Abandoned: what it still holds was never settled, and is read
		// again from the durable position.
		defer l.closing.Done()
		l.closeSink(old, 5*time.Second)
	}()
	l.failure = nil
	if l.cfg.OnPause != nil {
		l.cfg.OnPause(l.cfg.Clock.Now(), cause)
	}
	for attempt := 1; ; attempt++ {
		wait := backoff.Delay(l.cfg.BackoffMin, l.cfg.BackoffMax, attempt)
		log.Warn().Err(cause).Str("retry_in", wait.String()).Int("attempt", attempt).
			Msg("kafka failed; keeping the replication connection until a producer connects again")
		if err := l.pause(ctx, l.cfg.Clock.Now().Add(wait), nil); err != nil {
			return err
		}
		// Connecting may take as long as sarama's metadata retries; the
		// loop's duties go on meanwhile.
		var m struct {
			sink sink.Sink
			err  error
		}
		made := make(chan struct{})
		go func() {
			defer close(made)
			m.sink, m.err = l.cfg.NewSink()
		}()
		if err := l.pause(ctx, time.Time{}, made); err != nil {
			go func() {
				// Closed once made; nothing waits for it.
				<-made
				if m.err == nil {
					m.sink.Close(time.Second)
				}
			}()
			return err
		}
		if m.err != nil {
			cause = m.err
			continue
		}
		// Only a sign of life: the next session makes its own producer.
		l.closing.Add(1)
		go func() {
			defer l.closing.Done()
			m.sink.Close(time.Second)
		}()
		log.Info().Msg("kafka is reachable again; re-streaming from the confirmed position")
		return nil
	}
}

// pause keeps the loop's duties without reading or sending: until the given
// time (when not zero), or until ready is closed (when not nil), or ctx
// ends.
func (l *Loop) pause(ctx context.Context, until time.Time, ready <-chan struct{}) error {
	for {
		if err := l.duties(); err != nil {
			return err
		}
		now := l.cfg.Clock.Now()
		if !until.IsZero() && !now.Before(until) {
			return nil
		}
		next := l.src.Wake()
		if !until.IsZero() && until.Before(next) {
			next = until
		}
		l.timer.Reset(max(next.Sub(now), 0))
		select {
		case <-l.timer.C():
		case <-ready:
			l.timer.Stop()
			return nil
		case <-ctx.Done():
			l.timer.Stop()
			return ctx.Err()
		}
	}
}
