package relay

import (
	"context"
	"errors"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/backoff"
	"github.com/outbox-relay/outbox-relay/sink"
)

// kafkaRecoverable reports whether a session-ending error is Kafka's alone
// and a new producer may fix it, so the replication connection can stay
// up while Kafka is away. A fenced producer is not: a new one would fence
// the instance that now owns the stream.
func (s *readLoop) kafkaRecoverable(err error) bool {
	var perr *sink.Error
	return s.newSink != nil && errors.As(err, &perr) && perr.Class != sink.ClassPermanent &&
		!errors.Is(err, sink.ErrAuth) && !errors.Is(err, sink.ErrFenced)
}

// waitForKafka keeps the replication connection through a Kafka outage:
// it abandons the failed sink, keeps reporting status (so
// wal_sender_timeout never fires) and feeding the watchdog without reading
// WAL, and tries a new producer with backoff until one connects. The
// unacknowledged events stay in flight meanwhile, so the age of the oldest
// unpublished event keeps growing and the outage shows in the metrics,
// instead of as a relay stuck connecting with nothing in flight.
//
// The caller then ends the session and re-streams from the confirmed
// position. It cannot do that on the same connection: PostgreSQL 15's
// walsender ends a second START_REPLICATION on a connection at once.
func (s *readLoop) waitForKafka(ctx context.Context, cause error) error {
	log := s.log
	old := s.sink
	s.closing.Add(1)
	go func() {
		// Abandoned: what it still holds was never confirmed, and is sent
		// again from the confirmed position.
		defer s.closing.Done()
		s.closeSink(old, 5*time.Second)
	}()
	s.failure = nil
	s.paused = true
	s.report.pause(s.clock.Now(), cause)
	for attempt := 1; ; attempt++ {
		wait := backoff.Delay(s.cfg.backoffMin, s.cfg.backoffMax, attempt)
		log.Warn().Err(cause).Str("retry_in", wait.String()).Int("attempt", attempt).
			Msg("kafka failed; keeping the replication connection until a producer connects again")
		if err := s.pause(ctx, s.clock.Now().Add(wait), nil); err != nil {
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
			m.sink, m.err = s.newSink()
		}()
		if err := s.pause(ctx, time.Time{}, made); err != nil {
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
		s.closing.Add(1)
		go func() {
			defer s.closing.Done()
			m.sink.Close(time.Second)
		}()
		log.Info().Msg("kafka is reachable again; re-streaming from the confirmed position")
		return nil
	}
}

// pause keeps the loop's duties without reading or sending: until the given
// time (when not zero), or until ready is closed (when not nil), or ctx
// ends.
func (s *readLoop) pause(ctx context.Context, until time.Time, ready <-chan struct{}) error {
	for {
		if err := s.duties(); err != nil {
			return err
		}
		now := s.clock.Now()
		if !until.IsZero() && !now.Before(until) {
			return nil
		}
		next := s.nextWake()
		if !until.IsZero() {
			next = earliest(next, until)
		}
		s.timer.Reset(max(next.Sub(now), 0))
		select {
		case <-s.timer.C():
		case <-ready:
			s.timer.Stop()
			return nil
		case <-ctx.Done():
			s.timer.Stop()
			return ctx.Err()
		}
	}
}
