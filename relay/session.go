package relay

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
)

// session is one life of the stream: check, open the slot, publish and
// confirm until an error or ctx ends. Every failure ends the session; the
// next one re-reads from the slot's confirmed position.
func (r *Relay) session(ctx context.Context) (err error) {
	r.setState(StateConnecting, nil)
	start, senderTimeout, err := r.prepare(ctx)
	if err != nil {
		return err
	}

	tracker := lsn.NewTracker(start, lsn.Limits{Events: r.cfg.MaxInFlightEvents, Bytes: r.cfg.MaxInFlightBytes})
	outcomes := newOutcomes(tracker, r.metrics, r.log)
	if r.cfg.OnPermanentError == OnPermanentQuarantine {
		schema, table := r.cfg.quarantineTable()
		store, err := OpenQuarantine(ctx, r.cfg.Replication, schema, table)
		if err != nil {
			return err
		}
		defer store.Close()
		outcomes.quarantine = store
		r.metrics.refreshQuarantined(ctx, store)
	}
	pubCfg := r.cfg.Publisher
	r.mu.Lock()
	pubCfg.MaxMessageBytes = r.batchLimit
	r.mu.Unlock()
	s := &streamer{
		relay: r, tracker: tracker, outcomes: outcomes,
		received: start, flushedSent: start, lastStatus: time.Now(),
		keepaliveEvery: statusMaxInterval(r.cfg.StatusMaxInterval, senderTimeout),
	}
	pub, err := publisher.New(pubCfg, outcomes, publisher.Waiting{Interval: r.cfg.StatusInterval, Do: s.whileBlocked}, r.log)
	if err != nil {
		return err
	}
	stream, err := replication.OpenStream(ctx, r.cfg.Replication)
	if err != nil {
		pub.Close(time.Second)
		return err
	}
	if err := stream.Start(ctx, start); err != nil {
		stream.Close(context.Background())
		pub.Close(time.Second)
		return err
	}

	s.stream, s.pub = stream, pub
	r.setStreaming(tracker)
	r.log.Info().Str("start_lsn", start.String()).
		Dur("status_every", s.keepaliveEvery).Msg("streaming")
	if r.hooks.Streaming != nil {
		r.hooks.Streaming()
	}

	err = s.run(ctx)
	if ctx.Err() != nil && (err == nil || errors.Is(err, context.Canceled)) {
		return s.drain()
	}
	stream.Close(context.Background())
	if cerr := pub.Close(5 * time.Second); cerr != nil {
		r.log.Warn().Err(cerr).Msg("abandoned the failed session's producer")
	}
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
		start, err = r.resume(ctx, at) // progress: resume where Kafka is
		return start, senderTimeout, err
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
	if start, err = slot.Confirmed(); err != nil {
		return 0, 0, err
	}
	start, err = r.resume(ctx, start) // progress: resume where Kafka is
	return start, senderTimeout, err
}

// idleConfirmDelay is how soon a moved position is reported once nothing is
// in flight any more, instead of waiting out StatusInterval: it keeps the
// slot's lag small after a burst at the cost of at most ten updates a second.
const idleConfirmDelay = 100 * time.Millisecond

// statusMaxInterval keeps status updates well inside wal_sender_timeout.
func statusMaxInterval(configured, senderTimeout time.Duration) time.Duration {
	if senderTimeout > 0 && senderTimeout/3 < configured {
		return max(senderTimeout/3, 100*time.Millisecond)
	}
	return configured
}

// streamer is the state of one session's read loop.
type streamer struct {
	relay    *Relay
	stream   *replication.Stream
	pub      *publisher.Publisher
	tracker  *lsn.Tracker
	outcomes *outcomes

	txn        lsn.TxnID
	inTxn      bool
	rowSeen    bool // the open transaction's first row was read
	commitTime time.Time
	event      publisher.Event

	received       lsn.LSN // highest position read
	flushedSent    lsn.LSN // flush position last reported
	lastStatus     time.Time
	keepaliveEvery time.Duration
}

// run reads and publishes until an error, a producer failure or ctx ends.
func (s *streamer) run(ctx context.Context) error {
	cfg := &s.relay.cfg
	timer := time.NewTimer(cfg.StatusInterval)
	defer timer.Stop()
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := s.outcomes.failure(); err != nil {
			return err
		}
		if err := s.statusIfDue(false); err != nil {
			return err
		}
		if s.relay.hooks.Alive != nil {
			s.relay.hooks.Alive()
		}
		if s.tracker.Full() {
			if s.tracker.Confirmed() != s.flushedSent {
				// Room comes from telling PostgreSQL what is confirmed.
				if err := s.statusIfDue(true); err != nil {
					return err
				}
				continue
			}
			// Stop reading WAL until acks free room; keep reporting status so
			// wal_sender_timeout never fires while Kafka is slow.
			timer.Reset(cfg.StatusInterval)
			select {
			case <-s.tracker.Freed():
			case <-s.outcomes.failed:
			case <-timer.C:
			case <-ctx.Done():
			}
			continue
		}
		msg, err := s.stream.Receive(s.nextWake())
		if err != nil {
			return err
		}
		if err := s.handle(ctx, msg); err != nil {
			return err
		}
	}
}

// nextWake is when the read loop must look at its status again even if no
// message comes: every StatusInterval at the latest (the loop's heartbeat,
// which the systemd watchdog follows), at the keepalive, every
// idleConfirmDelay while acks are pending (to notice the last one soon),
// and when an idle tracker's moved position becomes due. Without the last,
// a position that moved just after an update waited a whole StatusInterval,
// and a burst's tail sat unconfirmed that long.
func (s *streamer) nextWake() time.Time {
	now := time.Now()
	next := now.Add(s.relay.cfg.StatusInterval)
	switch {
	case !s.tracker.Idle():
		next = now.Add(idleConfirmDelay)
	case s.tracker.Confirmed() != s.flushedSent:
		next = earliest(next, s.lastStatus.Add(idleConfirmDelay))
	}
	return earliest(next, s.lastStatus.Add(s.keepaliveEvery))
}

func earliest(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func (s *streamer) handle(ctx context.Context, msg *replication.Message) error {
	switch msg.Kind {
	case replication.KindBegin:
		if s.inTxn {
			return fmt.Errorf("replication stream: begin of xid %d inside an open transaction", msg.XID)
		}
		s.txn = s.tracker.Open(msg.CommitTime)
		s.inTxn, s.rowSeen = true, false
		s.commitTime = msg.CommitTime
	case replication.KindRow:
		if !s.inTxn {
			return errors.New("replication stream: row outside a transaction")
		}
		if !s.rowSeen {
			s.rowSeen = true
			s.relay.metrics.CommitToReceive.Observe(time.Since(s.commitTime).Seconds())
		}
		return s.publish(ctx, &msg.Row)
	case replication.KindCommit:
		if !s.inTxn {
			return errors.New("replication stream: commit outside a transaction")
		}
		s.tracker.Close(s.txn, msg.EndLSN)
		s.inTxn = false
		s.received = max(s.received, msg.EndLSN)
	case replication.KindKeepalive:
		s.received = max(s.received, msg.ServerWALEnd)
		if !s.inTxn {
			// Nothing open and, if the tracker agrees, nothing unacknowledged:
			// the server's WAL end is safe, and confirming it lets the slot
			// release WAL that only other tables wrote.
			s.tracker.ConfirmIdle(msg.ServerWALEnd)
		}
		if msg.ReplyRequested {
			return s.statusIfDue(true)
		}
	}
	return nil
}

// eventOf maps a decoded outbox row to the publisher's event; the slices
// still alias the read buffer.
func eventOf(row *replication.Row, txn lsn.TxnID, commitTime time.Time) publisher.Event {
	v := &row.Values
	return publisher.Event{
		EventID:       v[replication.FieldEventID],
		AggregateType: v[replication.FieldAggregateType],
		AggregateID:   v[replication.FieldAggregateID],
		EventType:     v[replication.FieldEventType],
		SchemaVersion: v[replication.FieldSchemaVersion],
		Payload:       v[replication.FieldPayload],
		Headers:       v[replication.FieldHeaders],
		OccurredAt:    v[replication.FieldOccurredAt],
		Txn:           uint64(txn),
		CommitTime:    commitTime,
	}
}

// publish builds and sends one outbox row.
func (s *streamer) publish(ctx context.Context, row *replication.Row) error {
	ev := &s.event
	*ev = eventOf(row, s.txn, s.commitTime)
	rec, err := s.build(ev)
	if err != nil {
		var perr *publisher.Error
		if errors.As(err, &perr) && perr.Class == publisher.ClassPermanent && s.outcomes.quarantine != nil {
			// Never sent, so nothing is in flight for it: once it is stored,
			// the slot may pass it.
			return s.outcomes.quarantineEvent(ctx, fromEvent(ev, perr), perr)
		}
		return err
	}
	s.tracker.Add(s.txn, rec.Size())
	return s.pub.Send(ctx, rec)
}

// build checks the row's required values, then builds its record.
func (s *streamer) build(ev *publisher.Event) (*publisher.Record, error) {
	for _, col := range []struct {
		name  string
		value []byte
	}{{"aggregate_id", ev.AggregateID}, {"aggregate_type", ev.AggregateType}, {"event_type", ev.EventType}, {"payload", ev.Payload}} {
		if col.value == nil {
			return nil, &publisher.Error{Class: publisher.ClassPermanent, EventID: string(ev.EventID), Partition: -1,
				Err: fmt.Errorf("row has NULL %s; the outbox table's columns must be NOT NULL (see migrate)", col.name)}
		}
	}
	return s.pub.Build(ev)
}

// whileBlocked keeps the session's duties while the publisher blocks the
// read loop: notice producer failures, and report status.
func (s *streamer) whileBlocked() error {
	if err := s.outcomes.failure(); err != nil {
		return err
	}
	return s.statusIfDue(false)
}

// statusIfDue reports positions when the confirmed position moved and a
// StatusInterval passed (or idleConfirmDelay, once nothing is in flight),
// when keepaliveEvery passed, or when forced.
func (s *streamer) statusIfDue(force bool) error {
	if !s.inTxn {
		// A keepalive's WAL end may have arrived while acks were pending;
		// once they are in, it is safe, and without this the slot would
		// hold that tail of WAL until the database writes again.
		s.tracker.ConfirmIdle(s.received)
	}
	now := time.Now()
	since := now.Sub(s.lastStatus)
	confirmed := s.tracker.Confirmed()
	moved := confirmed != s.flushedSent
	due := force || since >= s.keepaliveEvery ||
		moved && (since >= s.relay.cfg.StatusInterval || since >= idleConfirmDelay && s.tracker.Idle())
	if !due {
		return nil
	}
	if err := s.stream.SendStatus(s.received, confirmed); err != nil {
		return err
	}
	s.tracker.Reported(confirmed)
	s.lastStatus, s.flushedSent = now, confirmed
	stats := s.tracker.Stats()
	m := s.relay.metrics
	m.ReceivedLSN.Set(float64(s.received))
	m.ConfirmedLSN.Set(float64(confirmed))
	m.InFlightEvents.Set(float64(stats.InFlightEvents))
	if stats.OldestInFlight.IsZero() {
		m.OldestUnpublished.Set(0)
	} else {
		m.OldestUnpublished.Set(now.Sub(stats.OldestInFlight).Seconds())
	}
	// Only what was confirmed before this update was sent counts for
	// retention: stats may already be newer than the flush position sent.
	if stats.Confirmed == confirmed {
		s.relay.noteProgress(s.received, stats.ConfirmedCommitTime)
	} else {
		s.relay.noteProgress(s.received, time.Time{})
	}
	// progress: stats.Confirmed is tracker-confirmed (acked), never ahead of Kafka.
	s.relay.offerProgress(stats.Confirmed, stats.ConfirmedCommitTime)
	return nil
}

// drain ends a session on shutdown: stop reading, wait (bounded) for the
// acks of what is in flight, confirm them, and close.
func (s *streamer) drain() error {
	log := s.relay.log
	s.relay.setState(StateDraining, nil)
	deadline := time.Now().Add(s.relay.cfg.ShutdownTimeout)
	for s.tracker.Stats().InFlightEvents > 0 && time.Now().Before(deadline) && s.outcomes.failure() == nil {
		select {
		case <-s.tracker.Freed():
		case <-time.After(s.relay.cfg.StatusInterval):
		}
		if err := s.statusIfDue(false); err != nil {
			break
		}
	}
	stats := s.tracker.Stats()
	if stats.InFlightEvents > 0 {
		log.Warn().Int("in_flight_events", stats.InFlightEvents).
			Msg("shutdown timeout reached with events unacknowledged; they will be re-delivered on the next start")
	}
	err := s.statusIfDue(true)
	s.stream.Close(context.Background())
	if cerr := s.pub.Close(5 * time.Second); cerr != nil && err == nil {
		err = cerr
	}
	log.Info().Str("confirmed_lsn", stats.Confirmed.String()).Msg("stopped cleanly")
	return err
}

// outcomes receives the producer's acks and failures for one session.
type outcomes struct {
	tracker    *lsn.Tracker
	metrics    *Metrics
	log        zerolog.Logger
	quarantine *QuarantineStore // nil when permanent errors halt the relay
	failed     chan struct{}
	first      atomic.Pointer[publisher.Error]
}

func newOutcomes(t *lsn.Tracker, m *Metrics, log zerolog.Logger) *outcomes {
	return &outcomes{tracker: t, metrics: m, log: log, failed: make(chan struct{})}
}

func (o *outcomes) Acked(d publisher.Delivery) {
	o.tracker.Ack(lsn.TxnID(d.Txn), d.Bytes)
	o.metrics.acked(d)
}

func (o *outcomes) Retrying() { o.metrics.Retries.Inc() }

func (o *outcomes) Failed(d publisher.Delivery, err *publisher.Error) {
	o.metrics.failed(err)
	if err.Class == publisher.ClassPermanent && o.quarantine != nil && err.Record != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		qerr := o.quarantineEvent(ctx, fromRecord(err.Record, err), err)
		cancel()
		if qerr == nil {
			// Stored: account for it as delivered so the line moves on.
			o.tracker.Ack(lsn.TxnID(d.Txn), d.Bytes)
			return
		}
		o.log.Error().Err(qerr).Str("event_id", err.EventID).Msg("could not quarantine the event; re-streaming it")
	}
	if err.Partition >= 0 {
		// sarama keeps appending later batches to a partition after one
		// failed (measured with OUT_OF_ORDER_SEQUENCE_NUMBER), so the
		// re-delivered event may land after events committed later.
		o.log.Warn().Str("topic", err.Topic).Int32("partition", err.Partition).Str("event_id", err.EventID).
			Str("class", string(err.Class)).Err(err.Err).
			Msg("record failed after reaching its partition: per-aggregate order on this partition may break when it is re-delivered")
	}
	if o.first.CompareAndSwap(nil, err) {
		close(o.failed)
	}
}

// quarantineEvent stores an event Kafka will never accept, loudly.
func (o *outcomes) quarantineEvent(ctx context.Context, q Quarantined, perr *publisher.Error) error {
	if q.Payload == "" {
		q.Payload = "null"
	}
	if err := o.quarantine.Put(ctx, q); err != nil {
		return err
	}
	o.metrics.refreshQuarantined(ctx, o.quarantine)
	o.log.Error().Str("event_id", q.EventID).Str("topic", q.Topic).Str("class", string(perr.Class)).Err(perr.Err).
		Str("advice", perr.Advice()).
		Msg("event quarantined: Kafka will not accept it; fix the cause, then `outbox-relay quarantine replay`")
	return nil
}

// failure returns the session's first producer failure, if any. Nothing at
// or after the failed event is ever confirmed: its transaction never
// completes in the tracker.
func (o *outcomes) failure() error {
	if err := o.first.Load(); err != nil {
		return err
	}
	return nil
}
