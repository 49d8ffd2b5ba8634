package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/pipeline"
)

// kafkaStall is how long the events in flight have waited with no
// acknowledgement from Kafka: since the later of the last ack and the
// oldest unacknowledged send. It is zero unless the relay streams with
// events in flight, so a catch-up whose acks keep coming, or an event
// just sent after an idle hour, never counts as a stall.
func (r *Relay) kafkaStall(now time.Time) (stalled time.Duration, inFlight int) {
	r.mu.Lock()
	s := r.status
	r.mu.Unlock()
	return r.stallOf(s, r.report.snapshot(), now)
}

// stallOf is kafkaStall of the status as set (not as current derives it)
// and the WAL reader's report.
func (r *Relay) stallOf(s Status, read readSnapshot, now time.Time) (stalled time.Duration, inFlight int) {
	tracker := s.tracker
	if tracker == nil || s.State != pipeline.StateStreaming || !read.draining.IsZero() {
		return 0, 0
	}
	st := tracker.Stats()
	if st.InFlightEvents == 0 || st.OldestInFlight.IsZero() {
		return 0, 0
	}
	from := st.OldestInFlight
	if last := r.report.lastAck.get(); last.After(from) {
		from = last
	}
	return max(0, now.Sub(from)), st.InFlightEvents
}

// stallReason is why the relay waits for Kafka during a stall, and since
// when; "" when Kafka acknowledges within the configured time.
func (r *Relay) stallReason(s Status, read readSnapshot, now time.Time) (string, time.Time) {
	stalled, inFlight := r.stallOf(s, read, now)
	if stalled < r.cfg.KafkaStallTimeout {
		return "", time.Time{}
	}
	return fmt.Sprintf("kafka-stalled: no acknowledgement from Kafka for %s with %d events in flight (--kafka-stall-timeout %s)",
		stalled.Round(time.Second), inFlight, r.cfg.KafkaStallTimeout), now.Add(-stalled)
}

// watchStall keeps the stall gauge and logs a stall when it starts, every
// --kafka-stall-timeout while it lasts, and when it ends. It runs apart
// from the engine loop, so a loop blocked on Kafka is still reported.
func (r *Relay) watchStall(ctx context.Context, tick time.Duration) {
	t := time.NewTicker(tick)
	defer t.Stop()
	var stalledSince, lastWarned time.Time
	for {
		select {
		case <-ctx.Done():
			r.metrics.KafkaStall.Set(0)
			return
		case now := <-t.C:
			stalled, inFlight := r.kafkaStall(now)
			r.metrics.KafkaStall.Set(stalled.Seconds())
			switch {
			case stalled >= r.cfg.KafkaStallTimeout:
				if stalledSince.IsZero() {
					stalledSince = now.Add(-stalled)
				}
				if now.Sub(lastWarned) >= r.cfg.KafkaStallTimeout {
					lastWarned = now
					r.log.Warn().Str("stalled_for", stalled.Round(time.Second).String()).Int("in_flight_events", inFlight).
						Strs("kafka_brokers", r.cfg.Sinks.Brokers()).
						Msg("kafka has not acknowledged any event for longer than --kafka-stall-timeout: /readyz reports not ready until it does. Check the brokers and the relay's network path to them; events wait in the slot meanwhile and nothing is lost")
				}
			case !stalledSince.IsZero():
				r.log.Info().Str("stalled_for", now.Sub(stalledSince).Round(time.Second).String()).
					Msg("kafka acknowledges again after a stall")
				stalledSince, lastWarned = time.Time{}, time.Time{}
			}
		}
	}
}
