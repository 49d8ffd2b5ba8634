package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/engine"
	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
)

// idleConfirmDelay is how soon a moved position is reported once nothing is
// in flight any more, instead of waiting out StatusInterval: it keeps the
// slot's lag small after a burst at the cost of at most ten updates a second.
// It is also how often the loop stops reading to take acks while some are
// pending and the stream is quiet.
const idleConfirmDelay = 100 * time.Millisecond

// statusMaxInterval keeps status updates well inside wal_sender_timeout.
func statusMaxInterval(configured, senderTimeout time.Duration) time.Duration {
	if senderTimeout > 0 && senderTimeout/3 < configured {
		return max(senderTimeout/3, 100*time.Millisecond)
	}
	return configured
}

// loopConfig is what the WAL reader takes from the relay's configuration.
type loopConfig struct {
	statusInterval  time.Duration
	shutdownTimeout time.Duration
	readTick        time.Duration
	backoffMin      time.Duration // between attempts to reach Kafka again
	backoffMax      time.Duration
	exactlyOnce     bool
	// layout says what shape of record each row makes.
	layout *layout.Layout
}

func (c Config) loop() loopConfig {
	return loopConfig{
		statusInterval: c.StatusInterval, shutdownTimeout: c.ShutdownTimeout, readTick: c.ReadTick,
		backoffMin: c.BackoffMin, backoffMax: c.BackoffMax, exactlyOnce: c.exactlyOnce(),
		layout: c.Replication.OutboxLayout(),
	}
}

// loopEnv is what a WAL reader is given to work with, besides the stream
// of its session. What it learns goes out as data: its reading into
// report, the records Kafka stored to keeper, the Kafka transactions'
// ends to delivery; it reads back only the slot watch's view of the slot.
// None of it calls into the relay.
type loopEnv struct {
	cfg     loopConfig
	log     zerolog.Logger
	metrics *Metrics
	// report is where the loop publishes its reading (nil: nowhere), and
	// alive tells the watchdog the loop turns (nil: none watches).
	report *readReport
	alive  func()
	// slot is the slot watch's view of the slot's position, for the age
	// of unpublished events while the loop reads nothing (nil: none).
	slot *slotView
	// keeper keeps what the progress records Kafka stored say.
	keeper   *progressKeeper
	delivery *exactlyOnce
	clock    clock
	// skips remembers, across sessions, which kinds of skipped message
	// were logged: each is logged once per process, then only counted.
	skips *skipNotes
}

// walReader is the WAL and messages sources' side of a session's engine
// loop: it reads the replication stream, hands the engine each event and
// each transaction's end, and makes what the engine settles durable by
// confirming the slot's position, which only the tracker moves.
type walReader struct {
	loopEnv
	stream  walStream
	tracker *lsn.Tracker

	txn        lsn.TxnID
	inTxn      bool
	rowSeen    bool // the open transaction's first row was read
	commitTime time.Time
	event      event.Event
	read       [1]engine.Event
	row        *replication.Row // the row read last, for keepRaw
	rowAt      lsn.LSN
	keep       func(q *Quarantined) // keepRaw, bound once

	received       lsn.LSN // highest position read
	flushedSent    lsn.LSN // flush position last reported
	lastStatus     time.Time
	keepaliveEvery time.Duration
	alive          liveness
	readTick       time.Duration
	txnEnded       bool // a commit was the last message handled
	timer          timer
	paused         bool // waiting for Kafka: nothing is read, so the tracker's age says nothing
	draining       bool
	// takeRetries returns the sink's retries since the last call; nil:
	// none are counted.
	takeRetries func() int64

	// txnSink says the sink writes Kafka transactions: it gets the end of
	// every source transaction, with the progress record to write there.
	txnSink  bool
	progress txnProgress
	// feed takes each confirmed position to the at-least-once progress
	// writer, and brings back what it stored; nil in exactly-once mode,
	// where commits report it.
	feed *progressFeed
}

func newWALReader(env loopEnv, stream walStream, t *lsn.Tracker, start lsn.LSN, keepaliveEvery time.Duration, alive liveness) *walReader {
	s := &walReader{
		loopEnv: env, stream: stream, tracker: t,
		received: start, flushedSent: start, lastStatus: env.clock.Now(), keepaliveEvery: keepaliveEvery, alive: alive,
		timer: env.clock.NewTimer(env.cfg.statusInterval), readTick: env.cfg.readTick,
		txnSink: env.cfg.exactlyOnce,
	}
	s.timer.Stop()
	s.keep = s.keepRaw
	return s
}

// engineConfig is the engine's configuration for a session read by s.
func (r *Relay) engineConfig(s *walReader, q *engine.Quarantiner, newSink func() (sink.Sink, error)) engine.Config {
	c := r.cfg.loop()
	return engine.Config{
		Log: r.log, Metrics: r.metrics.Metrics, Clock: r.clock, Alive: r.hooks.Alive,
		ShutdownTimeout: c.shutdownTimeout, BackoffMin: c.backoffMin, BackoffMax: c.backoffMax,
		Transactional: c.exactlyOnce, Quarantine: q, NewSink: newSink,
		OnKafkaTxn: func(rep sink.TxnReport) { s.delivery.ended(rep, s.progress.timeline) },
		OnPause: func(at time.Time, cause error) {
			s.paused = true
			s.report.pause(at, cause)
		},
		OnDrain: func() {
			// The state goes out as data: the relay's status reads it from
			// the report while its own says streaming.
			s.draining = true
			s.report.drain(time.Now())
			s.metrics.SetState(pipeline.StateDraining)
		},
	}
}

// quarantineStored is what the log says of each event quarantined.
const quarantineStored = "event quarantined: Kafka will not accept it; fix the cause, then `outbox-relay quarantine replay`"

// gatherMaxAge is how recent a transaction's commit must be for the reader
// to gather after it: only a reader that keeps up pauses. Catching up on a
// backlog, a read can end exactly at a commit with megabytes still in the
// socket, and a pause there would only slow the drain.
const gatherMaxAge = time.Second

// Next reads the stream until deadline for the next event or the end of a
// transaction.
func (s *walReader) Next(ctx context.Context, deadline time.Time) (engine.Read, error) {
	if s.txnEnded {
		s.txnEnded = false
		if s.readTick > 0 && !s.stream.Buffered() && s.clock.Now().Sub(s.commitTime) < gatherMaxAge {
			s.gather(ctx)
			return engine.Read{}, nil
		}
	}
	msg, err := s.stream.Receive(deadline)
	if err != nil {
		return engine.Read{}, err
	}
	if msg.Kind == replication.KindNone {
		if err := s.alive.check(s.clock.Now(), s.stream.Heard()); err != nil {
			return engine.Read{}, err
		}
	}
	return s.handle(msg)
}

// gather waits readTick before the next read once a recent transaction
// ended and nothing more is buffered. At a steady rate the walsender writes
// each message of each transaction by itself, so a reader that reads at
// once wakes up to three times per event, and the producer's goroutines
// behind it once more each; after a pause one read takes every transaction
// that arrived meanwhile, and the sink gets them as one burst. Outcomes
// wait in their buffer meanwhile and are taken together after it.
func (s *walReader) gather(ctx context.Context) {
	s.timer.Reset(s.readTick)
	defer s.timer.Stop()
	select {
	case <-s.timer.C():
	case <-ctx.Done():
	}
}

// Wake is when the reader must look at its status again even if no
// message comes: every StatusInterval at the latest (the loop's heartbeat,
// which the systemd watchdog follows), at the keepalive, every
// idleConfirmDelay while acks are pending (to take them), and when an idle
// tracker's moved position becomes due. Without the last, a position that
// moved just after an update waited a whole StatusInterval, and a burst's
// tail sat unconfirmed that long.
func (s *walReader) Wake() time.Time {
	now := s.clock.Now()
	next := now.Add(s.cfg.statusInterval)
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

// Full says the tracker's in-flight limits are reached.
func (s *walReader) Full() bool { return s.tracker.Full() }

// InTransaction says a transaction was begun and not yet committed.
func (s *walReader) InTransaction() bool { return s.inTxn }

// Sent counts the bytes of an event in flight; the event itself counts
// from when it was read, so one that waits for its topic's lookup shows
// as in flight, and holds the stream.
func (s *walReader) Sent(_ engine.Position, bytes int) { s.tracker.Grow(bytes) }

// Settle acks what Kafka or the quarantine table holds. A failure ends
// the session: nothing at or after the failed event is ever confirmed,
// since its transaction never completes in the tracker, and the next
// session reads it again from the slot.
func (s *walReader) Settle(pos engine.Position, f engine.Fate) error {
	switch {
	case f.Acked:
		s.tracker.Ack(lsn.TxnID(pos), f.Bytes)
		s.metrics.acked(f.Delivery)
		s.report.acked(f.Delivery.At)
	case f.Quarantined:
		s.tracker.Ack(lsn.TxnID(pos), f.Bytes)
	case f.Err != nil:
		return f.Err
	}
	return nil
}

// Duties reports status when due; when the tracker is full and its
// confirmed position moved, at once, since room comes from telling
// PostgreSQL what is confirmed.
func (s *walReader) Duties(force bool) error {
	if s.tracker.Full() && s.tracker.Confirmed() != s.flushedSent {
		force = true
	}
	return s.statusIfDue(force)
}

func (s *walReader) handle(msg *replication.Message) (engine.Read, error) {
	switch msg.Kind {
	case replication.KindBegin:
		if s.inTxn {
			return engine.Read{}, fmt.Errorf("replication stream: begin of xid %d inside an open transaction", msg.XID)
		}
		s.txn = s.tracker.Open(msg.CommitTime)
		s.inTxn, s.rowSeen = true, false
		s.commitTime = msg.CommitTime
	case replication.KindRow:
		if !s.inTxn {
			return engine.Read{}, errors.New("replication stream: row outside a transaction")
		}
		if !s.rowSeen {
			s.rowSeen = true
			s.metrics.CommitToReceive.Observe(s.clock.Now().Sub(s.commitTime).Seconds())
		}
		return s.eventRead(&msg.Row, msg.WALStart), nil
	case replication.KindCommit:
		if !s.inTxn {
			return engine.Read{}, errors.New("replication stream: commit outside a transaction")
		}
		s.tracker.Close(s.txn, msg.EndLSN)
		var rd engine.Read
		if s.txnSink {
			rd.End = &sink.SourceEnd{Txn: s.txn, End: msg.EndLSN, CommitTime: s.commitTime, Progress: s.progress.record}
		}
		s.inTxn, s.txnEnded = false, true
		s.received = max(s.received, msg.EndLSN)
		return rd, nil
	case replication.KindSkippedMessage:
		s.skipped(msg.Skipped)
	case replication.KindKeepalive:
		s.received = max(s.received, msg.ServerWALEnd)
		if !s.inTxn {
			// Nothing open and, if the tracker agrees, nothing unacknowledged:
			// the server's WAL end is safe, and confirming it lets the slot
			// release WAL that only other tables wrote.
			s.tracker.ConfirmIdle(msg.ServerWALEnd)
		}
		if msg.ReplyRequested {
			return engine.Read{}, s.statusIfDue(true)
		}
	}
	return engine.Read{}, nil
}

// skipNotes are the kinds of skipped message already logged.
type skipNotes map[replication.Skip]bool

// skipped counts a logical decoding message that is not an event, and
// logs the first of each kind.
func (s *walReader) skipped(why replication.Skip) {
	reason, msg := skipOtherPrefix, "read a logical decoding message with another prefix than --message-prefix: another application emits messages in this database; skipping it and all such messages (counted in outbox_relay_messages_skipped_total)"
	if why == replication.SkipNonTransactional {
		reason, msg = skipNonTransactional, "read a non-transactional logical decoding message with this relay's prefix: it is not published, since it was written whether its transaction committed or not. "+
			"Emit events with pg_logical_emit_message(true, ...) (the writer library's Emit does); skipping it and all such messages (counted in outbox_relay_messages_skipped_total)"
	}
	s.metrics.MessagesSkipped.WithLabelValues(reason).Inc()
	if s.skips == nil || (*s.skips)[why] {
		return
	}
	(*s.skips)[why] = true
	ev := s.log.Info()
	if why == replication.SkipNonTransactional {
		ev = s.log.Warn()
	}
	ev.Str("reason", reason).Msg(msg)
}

// eventOf maps a decoded outbox row to its event; the slices
// still alias the read buffer.
func eventOf(row *replication.Row, l *layout.Layout, txn lsn.TxnID, commitTime time.Time) event.Event {
	v := &row.Values
	return event.Event{
		Extra:         row.Extra,
		Layout:        l,
		EventID:       v[replication.FieldEventID],
		AggregateType: v[replication.FieldAggregateType],
		AggregateID:   v[replication.FieldAggregateID],
		EventType:     v[replication.FieldEventType],
		SchemaVersion: v[replication.FieldSchemaVersion],
		Payload:       v[replication.FieldPayload],
		PayloadBinary: row.PayloadBinary,
		Headers:       v[replication.FieldHeaders],
		OccurredAt:    v[replication.FieldOccurredAt],
		ContentType:   v[replication.FieldContentType],
		Txn:           uint64(txn),
		CommitTime:    commitTime,
	}
}

// eventRead is the one event of an outbox row found at WAL position at.
// The row aliases the stream's read buffer, which stays valid because
// nothing is read until the engine sent it.
func (s *walReader) eventRead(row *replication.Row, at lsn.LSN) engine.Read {
	ev := &s.event
	*ev = eventOf(row, s.cfg.layout, s.txn, s.commitTime)
	ev.Position = uint64(at)
	s.row, s.rowAt = row, at
	s.tracker.Add(s.txn, 0)
	e := engine.Event{Event: ev}
	switch {
	case row.Unmapped != "" && row.ContentAt != 0: // a message's
		e.Refused = sink.BadContent(ev, row.Unmapped, row.ContentAt)
	case row.Unmapped != "":
		e.Refused = sink.UnmappedRow(ev, row.Unmapped, at)
	}
	if row.Content != nil || row.Dropped != nil {
		e.Keep = s.keep
	}
	s.read[0] = e
	return engine.Read{Events: s.read[:]}
}

// keepRaw adds to a quarantined event what the stream held of the row
// read last.
func (s *walReader) keepRaw(q *Quarantined) {
	row := s.row
	if row.Content != nil {
		// A message exists nowhere else: keep what the writer emitted,
		// for the operator and in case its values cannot be stored as
		// text. A copy: the content aliases the read buffer.
		q.Raw, q.RawLSN = bytes.Clone(row.Content), row.ContentAt
		q.ContentProblem = row.Unmapped
	}
	if d := row.Dropped; d != nil {
		// Dropped unread for its size: kept by reference only (a table's
		// row also stays in the table).
		q.RawSize, q.RawSHA256, q.RawLSN = d.Size, d.SHA256[:], s.rowAt
		q.ContentProblem = row.Unmapped
	}
}

// statusIfDue reports positions when the confirmed position moved and a
// StatusInterval passed (or idleConfirmDelay, once nothing is in flight),
// when keepaliveEvery passed, or when forced.
func (s *walReader) statusIfDue(force bool) error {
	if !s.inTxn {
		// A keepalive's WAL end may have arrived while acks were pending;
		// once they are in, it is safe, and without this the slot would
		// hold that tail of WAL until the database writes again.
		s.tracker.ConfirmIdle(s.received)
	}
	now := s.clock.Now()
	since := now.Sub(s.lastStatus)
	confirmed := s.tracker.Confirmed()
	moved := confirmed != s.flushedSent
	ping := s.alive.ping(now, s.stream.Heard())
	due := force || ping || since >= s.keepaliveEvery ||
		moved && (since >= s.cfg.statusInterval || since >= idleConfirmDelay && s.tracker.Idle())
	if !due {
		return nil
	}
	if err := s.stream.SendStatus(s.received, confirmed, ping); err != nil {
		return err
	}
	if ping {
		s.alive.pinged(now)
	}
	s.tracker.Reported(confirmed)
	s.lastStatus, s.flushedSent = now, confirmed
	stats := s.tracker.Stats()
	m := s.metrics
	m.ReceivedLSN.Set(float64(s.received))
	m.ConfirmedLSN.Set(float64(confirmed))
	m.InFlightEvents.Set(float64(stats.InFlightEvents))
	var age float64
	if !stats.OldestInFlight.IsZero() {
		age = now.Sub(stats.OldestInFlight).Seconds()
	}
	if s.paused {
		// Waiting for Kafka, the loop reads nothing: the events committed
		// meanwhile are known only from the slot's position.
		age = s.slot.unpublishedAge(now, age, false, s.report.snapshot().confirmedCommit)
	}
	m.OldestUnpublished.Set(age)
	if s.takeRetries != nil {
		if n := s.takeRetries(); n > 0 {
			m.Retries.Add(float64(n))
		}
	}
	// Only what was confirmed before this update was sent counts for
	// retention: stats may already be newer than the flush position sent.
	if stats.Confirmed == confirmed {
		s.report.position(s.received, stats.ConfirmedCommitTime)
	} else {
		s.report.position(s.received, time.Time{})
	}
	// The tracker confirms only what Kafka acknowledged, so the stored
	// progress can lag Kafka but never lead it.
	s.feed.offer(stats.Confirmed, stats.ConfirmedCommitTime)
	return nil
}

// Close ends the stream. A graceful close lets the server read the last
// status update before the connection goes.
func (s *walReader) Close(graceful bool) {
	s.timer.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if !graceful {
		ctx, cancel = context.WithCancel(ctx)
		cancel()
	}
	if err := s.stream.Close(ctx); err != nil && graceful {
		s.log.Warn().Err(err).Msg("could not end the replication stream cleanly; the slot may be re-read from an earlier position")
	}
	if s.draining {
		s.log.Info().Str("confirmed_lsn", s.flushedSent.String()).Msg("stopped cleanly")
	}
}
