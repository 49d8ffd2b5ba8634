package relay

import (
	"context"
	"errors"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/backoff"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/publisher"
)

// kafkaRecoverable reports whether a session-ending error is Kafka's alone
// and a new producer may fix it, so the replication connection can stay.
func (s *streamer) kafkaRecoverable(err error) bool {
	var perr *publisher.Error
	return s.newSink != nil && errors.As(err, &perr) && perr.Class != publisher.ClassPermanent &&
		!errors.Is(err, publisher.ErrAuth)
}

// recoverKafka replaces a failed sink while the replication connection
// stays up: it keeps reporting status (so wal_sender_timeout never fires)
// and the watchdog fed, backs off, makes a new sink, and then streams again
// from the confirmed position on the same connection. Meanwhile nothing is
// read, and the age of the oldest unpublished event keeps growing, so an
// outage shows in the metrics instead of as a relay stuck connecting.
func (s *streamer) recoverKafka(ctx context.Context, cause error) error {
	log := s.relay.log
	s.relay.metrics.Restarts.Inc()
	old := s.sink
	s.closing.Add(1)
	go func() {
		// Abandoned: what it still holds was never confirmed, and is sent
		// again from the confirmed position.
		defer s.closing.Done()
		old.Close(5 * time.Second)
	}()
	s.failure = nil
	for attempt := 1; ; attempt++ {
		wait := backoff.Delay(s.relay.cfg.BackoffMin, s.relay.cfg.BackoffMax, attempt)
		log.Warn().Err(cause).Str("retry_in", wait.String()).Int("attempt", attempt).
			Msg("kafka failed; keeping the replication connection and reconnecting the producer (events after the confirmed position are sent again)")
		if err := s.pause(ctx, s.clock.Now().Add(wait), nil); err != nil {
			return err
		}
		type made struct {
			sink sink
			err  error
		}
		result := make(chan made, 1)
		go func() {
			snk, err := s.newSink()
			result <- made{snk, err}
		}()
		var m made
		if err := s.pause(ctx, time.Time{}, func() bool {
			select {
			case m = <-result:
				return true
			default:
				return false
			}
		}); err != nil {
			// Closed once it is made; nothing waits for it.
			go func() {
				if m := <-result; m.err == nil {
					m.sink.Close(time.Second)
				}
			}()
			return err
		}
		if m.err != nil {
			cause = m.err
			continue
		}
		s.sink = m.sink
		break
	}

	if err := s.statusIfDue(true); err != nil {
		return err
	}
	from := s.flushedSent
	if err := s.source.Restart(ctx, from); err != nil {
		return err
	}
	limits := lsn.Limits{Events: s.relay.cfg.MaxInFlightEvents, Bytes: s.relay.cfg.MaxInFlightBytes}
	s.tracker = lsn.NewTracker(from, limits)
	s.tracker.UseClock(s.clock.Now)
	s.inTxn, s.received, s.retries = false, from, 0
	s.relay.setStreaming(s.tracker)
	log.Info().Str("start_lsn", from.String()).Msg("kafka is back; streaming again on the same replication connection")
	return nil
}

// pause keeps the loop's duties without reading or sending: until the given
// time (when not zero), or until ready reports true, or ctx ends.
func (s *streamer) pause(ctx context.Context, until time.Time, ready func() bool) error {
	tick := 10 * time.Millisecond // how often ready is looked at
	for {
		if err := s.duties(); err != nil {
			return err
		}
		now := s.clock.Now()
		if ready != nil && ready() || !until.IsZero() && !now.Before(until) {
			return nil
		}
		next := s.nextWake()
		if !until.IsZero() {
			next = earliest(next, until)
		}
		if ready != nil {
			next = earliest(next, now.Add(tick))
		}
		s.timer.Reset(max(next.Sub(now), 0))
		select {
		case <-s.timer.C():
		case <-ctx.Done():
			s.timer.Stop()
			return ctx.Err()
		}
	}
}
