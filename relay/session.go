package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
)

// session is one life of the stream: check, open the slot, publish and
// confirm until an error or ctx ends. Every failure ends the session; the
// next one re-reads from the slot's confirmed position. streamed says
// whether it got as far as streaming.
func (r *Relay) session(ctx context.Context) (streamed bool, err error) {
	r.setState(StateConnecting, nil)
	start, senderTimeout, err := r.prepare(ctx)
	if err != nil {
		return false, err
	}

	tracker := lsn.NewTracker(start, lsn.Limits{Events: r.cfg.MaxInFlightEvents, Bytes: r.cfg.MaxInFlightBytes})
	var quarantine *quarantiner
	if r.cfg.OnPermanentError == OnPermanentQuarantine {
		schema, table := r.cfg.quarantineTable()
		store, err := OpenQuarantine(ctx, r.cfg.Replication, schema, table)
		if err != nil {
			return false, err
		}
		defer store.Close()
		r.metrics.refreshQuarantined(ctx, store)
		refresh := func(ctx context.Context) { r.metrics.refreshQuarantined(ctx, store) }
		quarantine = newQuarantiner(store.table, store, refresh, r.cfg.MaxInFlightEvents+2)
	}
	pubCfg := r.cfg.Publisher
	r.mu.Lock()
	pubCfg.MaxMessageBytes = r.batchLimit
	r.mu.Unlock()
	pub, err := publisher.New(pubCfg, r.log)
	if err != nil {
		quarantine.stopIfStarted()
		return false, err
	}
	stream, err := replication.OpenStream(ctx, r.cfg.Replication)
	if err != nil {
		pub.Close(time.Second)
		quarantine.stopIfStarted()
		return false, err
	}
	if err := stream.Start(ctx, start); err != nil {
		stream.Close(context.Background())
		pub.Close(time.Second)
		quarantine.stopIfStarted()
		return false, err
	}

	s := newStreamer(r, wallClock{}, stream, pub, tracker, quarantine, start, statusMaxInterval(r.cfg.StatusMaxInterval, senderTimeout))
	s.newSink = func() (sink, error) {
		p, err := publisher.New(pubCfg, r.log)
		if err != nil {
			return nil, err
		}
		return p, nil
	}
	r.setStreaming(tracker)
	r.log.Info().Str("start_lsn", start.String()).
		Str("status_every", s.keepaliveEvery.String()).Msg("streaming")
	if r.hooks.Streaming != nil {
		r.hooks.Streaming()
	}
	return true, s.runToEnd(ctx)
}

// runToEnd runs the loop, then ends the session: a drain when ctx ended
// it; after a Kafka failure, a wait for Kafka with the replication
// connection kept; an abandon otherwise.
func (s *streamer) runToEnd(ctx context.Context) error {
	err := s.run(ctx)
	if ctx.Err() != nil && (err == nil || errors.Is(err, context.Canceled)) {
		return s.drain()
	}
	if s.kafkaRecoverable(err) {
		werr := s.waitForKafka(ctx, err)
		if ctx.Err() != nil {
			return s.drain()
		}
		if werr == nil {
			// Kafka is back: end the stream cleanly, and the next session
			// re-streams from the confirmed position.
			s.close(s.statusIfDue(true) == nil)
			return err
		}
		err = werr
	}
	s.close(false)
	return err
}

// prepare checks the server and the slot and returns where to start.
func (r *Relay) prepare(ctx context.Context) (start lsn.LSN, senderTimeout time.Duration, err error) {
	admin, err := replication.Connect(ctx, r.cfg.Replication)
	if err != nil {
		return 0, 0, err
	}
	defer admin.Close(context.Background())
	if err := admin.Check(ctx); err != nil {
		return 0, 0, err
	}
	senderTimeout, err = admin.SenderTimeout(ctx)
	if err != nil {
		return 0, 0, err
	}
	slot, exists, err := admin.Slot(ctx)
	if err != nil {
		return 0, 0, err
	}
	if exists && slot.Lost() && r.cfg.RecreateLostSlot {
		r.log.Error().
			Msg("slot was invalidated and --recreate-lost-slot is set: dropping and recreating it; events committed while it was lost are NOT delivered")
		if err := admin.DropSlot(ctx); err != nil {
			return 0, 0, err
		}
		exists = false
	}
	if !exists {
		at, err := admin.CreateSlot(ctx)
		if err != nil {
			return 0, 0, err
		}
		ev := r.log.Info()
		if rows, err := admin.CountRows(ctx); err != nil {
			// The relay's role need not read the table; the slot exists
			// either way, so say what could not be checked and go on.
			ev = r.log.Warn().AnErr("count_error", err)
		} else if rows > 0 {
			ev = r.log.Warn().Int64("rows_not_published", rows)
		}
		ev.Str("lsn", at.String()).
			Msg("created the replication slot; rows committed before it existed are not published (run `outbox-relay migrate` at deploy time so the slot exists before services write)")
		return at, senderTimeout, nil
	}
	if err := admin.CheckSlot(ctx, slot); err != nil {
		return 0, 0, err
	}
	if slot.Active {
		// Another process streams it. Say so before connecting to Kafka, so a
		// standby does not open a producer on every poll; START_REPLICATION
		// remains the real lock.
		pid := 0
		if slot.ActivePID != nil {
			pid = *slot.ActivePID
		}
		return 0, 0, fmt.Errorf("%w: replication slot %q is active for PID %d", replication.ErrSlotBusy, slot.Name, pid)
	}
	start, err = slot.Confirmed()
	return start, senderTimeout, err
}
