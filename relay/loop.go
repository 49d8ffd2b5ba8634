package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
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

// loopConfig is what the read loop takes from the relay's configuration.
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

// loopEnv is what a read loop is given to work with, besides the stream
// and the sink of its session. What the loop learns goes out as data: its
// reading into report, the records Kafka stored to keeper, the Kafka
// transactions' ends to delivery; it reads back only the slot watch's
// view of the slot. None of it calls into the relay.
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

// readLoop is one session's read loop. It alone touches the tracker's
// write side, the source and the sink: acks, failures and quarantine
// results all come to it over channels, and it waits for them in its own
// select, so nothing downstream ever calls back into it.
type readLoop struct {
	loopEnv
	source     walStream
	sink       sink.Sink
	tracker    *lsn.Tracker
	quarantine *quarantiner // nil when permanent errors halt the relay

	txn        lsn.TxnID
	inTxn      bool
	rowSeen    bool // the open transaction's first row was read
	commitTime time.Time
	event      event.Event

	received       lsn.LSN // highest position read
	flushedSent    lsn.LSN // flush position last reported
	lastStatus     time.Time
	keepaliveEvery time.Duration
	retries        int64 // the sink's retries already counted
	readTick       time.Duration
	txnEnded       bool // a commit was the last message handled
	quarantining   int  // events handed to the quarantine writer, not yet stored
	flushed        bool // a flush went to the sink since its last outcome
	timer          timer
	paused         bool      // waiting for Kafka: nothing is read, so the tracker's age says nothing
	failure        error     // the first outcome that ends the session
	finishBy       time.Time // set when a stop came inside a transaction

	// newSink makes a sink, to learn when Kafka is back after a failure;
	// nil: a Kafka failure ends the session at once.
	newSink func() (sink.Sink, error)

	// txnSink says the sink writes Kafka transactions: it gets the end of
	// every source transaction, with the progress record to write there,
	// and a flush when the in-flight limits are full.
	txnSink  bool
	progress txnProgress
	// feed takes each confirmed position to the at-least-once progress
	// writer, and brings back what it stored; nil in exactly-once mode,
	// where commits report it.
	feed    *progressFeed
	closing sync.WaitGroup // abandoned sinks being closed
}

func newReadLoop(env loopEnv, src walStream, snk sink.Sink, t *lsn.Tracker, q *quarantiner, start lsn.LSN, keepaliveEvery time.Duration) *readLoop {
	return &readLoop{
		loopEnv: env, source: src, sink: snk, tracker: t, quarantine: q,
		received: start, flushedSent: start, lastStatus: env.clock.Now(), keepaliveEvery: keepaliveEvery,
		timer: env.clock.NewTimer(env.cfg.statusInterval), readTick: env.cfg.readTick,
		txnSink: env.cfg.exactlyOnce,
	}
}

// run reads and publishes until an error, a session-ending outcome or ctx
// ends.
func (s *readLoop) run(ctx context.Context) error {
	for {
		if err := s.stopRequested(ctx); err != nil {
			return err
		}
		if err := s.takeOutcomes(); err != nil {
			return err
		}
		if err := s.duties(); err != nil {
			return err
		}
		if s.tracker.Full() {
			if s.tracker.Confirmed() != s.flushedSent {
				// Room comes from telling PostgreSQL what is confirmed.
				if err := s.statusIfDue(true); err != nil {
					return err
				}
				continue
			}
			// Stop reading WAL until acks free room; the wait wakes for
			// status too, so wal_sender_timeout never fires while Kafka is
			// slow. A transactional sink acks only once it commits, so it
			// is asked, once, to commit now rather than at its interval.
			var flush *sink.Item
			if s.txnSink && !s.flushed {
				flush = &sink.Item{Flush: true}
			}
			sent, err := s.wait(ctx, flush, nil)
			if err != nil {
				return err
			}
			s.flushed = s.flushed || sent
			continue
		}
		if s.txnEnded {
			s.txnEnded = false
			if s.readTick > 0 && !s.source.Buffered() && s.clock.Now().Sub(s.commitTime) < gatherMaxAge {
				s.gather(ctx)
				continue
			}
		}
		msg, err := s.source.Receive(s.nextWake())
		if err != nil {
			return err
		}
		if err := s.handle(ctx, msg); err != nil {
			return err
		}
	}
}

// gatherMaxAge is how recent a transaction's commit must be for the loop
// to gather after it: only a loop that keeps up pauses. Catching up on a
// backlog, a read can end exactly at a commit with megabytes still in the
// socket, and a pause there would only slow the drain.
const gatherMaxAge = time.Second

// gather waits readTick before the next read once a recent transaction
// ended and nothing more is buffered. At a steady rate the walsender writes
// each message of each transaction by itself, so a loop that reads at once
// wakes up to three times per event, and the producer's goroutines behind
// it once more each; after a pause one read takes every transaction that
// arrived meanwhile, and the sink gets them as one burst. Outcomes wait in
// their buffer meanwhile and are taken together after it.
func (s *readLoop) gather(ctx context.Context) {
	s.timer.Reset(s.readTick)
	defer s.timer.Stop()
	var stop <-chan struct{}
	if s.finishBy.IsZero() {
		stop = ctx.Done()
	}
	select {
	case <-s.timer.C():
	case <-stop:
	}
}

// stopRequested returns ctx's error once the session should stop. When ctx
// ends inside a transaction, the loop first reads on to its commit, for at
// most ShutdownTimeout: the events of it already sent can then be
// confirmed, and a clean stop leaves nothing to re-deliver.
func (s *readLoop) stopRequested(ctx context.Context) error {
	err := ctx.Err()
	if err == nil || !s.inTxn {
		return err
	}
	now := s.clock.Now()
	if s.finishBy.IsZero() {
		s.finishBy = now.Add(s.cfg.shutdownTimeout)
		s.log.Info().Msg("stopping: reading on to the end of the open transaction so what was sent of it can be confirmed")
	} else if now.After(s.finishBy) {
		return err
	}
	return nil
}

// duties are what the loop owes on every turn, however it waits: report
// status when due, and tell the watchdog it is alive.
func (s *readLoop) duties() error {
	if err := s.statusIfDue(false); err != nil {
		return err
	}
	if s.alive != nil { // nil: no watchdog watches this process
		s.alive()
	}
	return nil
}

// wait blocks until something needs the loop: item accepted by the sink
// (when item is given), an outcome, a quarantine result, ready closed, the
// next wake-up, or ctx ending. It reports whether item was sent, and the
// session-ending failure if one arrived.
func (s *readLoop) wait(ctx context.Context, item *sink.Item, ready <-chan struct{}) (sent bool, err error) {
	var in chan<- sink.Item
	var it sink.Item
	if item != nil {
		in, it = s.sink.Input(), *item
	}
	var stored <-chan quarantineResult
	if s.quarantine != nil {
		stored = s.quarantine.results
	}
	s.timer.Reset(max(s.nextWake().Sub(s.clock.Now()), 0))
	// Stopped again on the way out, so an armed timer means a wait is on.
	defer s.timer.Stop()
	var stop <-chan struct{}
	if s.finishBy.IsZero() {
		stop = ctx.Done() // once finishing a transaction, stop was seen
	}
	select {
	case in <- it:
		sent = true
	case o, ok := <-s.sink.Outcomes():
		if !ok {
			return false, errors.New("kafka producer stopped reporting outcomes")
		}
		s.outcome(o)
	case res := <-stored:
		s.stored(res)
	case <-ready:
	case <-s.timer.C():
	case <-stop:
	}
	if s.failure != nil {
		return sent, s.failure
	}
	return sent, s.stopRequested(ctx)
}

// takeOutcomes handles every outcome and quarantine result already there,
// without waiting.
func (s *readLoop) takeOutcomes() error {
	var stored <-chan quarantineResult
	if s.quarantine != nil {
		stored = s.quarantine.results
	}
	for {
		select {
		case o, ok := <-s.sink.Outcomes():
			if !ok {
				return errors.New("kafka producer stopped reporting outcomes")
			}
			s.outcome(o)
		case res := <-stored:
			s.stored(res)
		default:
			return s.failure
		}
	}
}

// nextWake is when the read loop must look at its status again even if no
// message comes: every StatusInterval at the latest (the loop's heartbeat,
// which the systemd watchdog follows), at the keepalive, every
// idleConfirmDelay while acks are pending (to take them), and when an idle
// tracker's moved position becomes due. Without the last, a position that
// moved just after an update waited a whole StatusInterval, and a burst's
// tail sat unconfirmed that long.
func (s *readLoop) nextWake() time.Time {
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

func (s *readLoop) handle(ctx context.Context, msg *replication.Message) error {
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
			s.metrics.CommitToReceive.Observe(s.clock.Now().Sub(s.commitTime).Seconds())
		}
		return s.publish(ctx, &msg.Row, msg.WALStart)
	case replication.KindCommit:
		if !s.inTxn {
			return errors.New("replication stream: commit outside a transaction")
		}
		s.tracker.Close(s.txn, msg.EndLSN)
		if err := s.awaitQuarantined(ctx); err != nil {
			return err
		}
		if s.txnSink {
			end := &sink.SourceEnd{Txn: s.txn, End: msg.EndLSN, CommitTime: s.commitTime, Progress: s.progress.record}
			if err := s.send(ctx, sink.Item{End: end}); err != nil {
				return err
			}
		}
		s.inTxn, s.txnEnded = false, true
		s.received = max(s.received, msg.EndLSN)
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
			return s.statusIfDue(true)
		}
	}
	return nil
}

// skipNotes are the kinds of skipped message already logged.
type skipNotes map[replication.Skip]bool

// skipped counts a logical decoding message that is not an event, and
// logs the first of each kind.
func (s *readLoop) skipped(why replication.Skip) {
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

// awaitQuarantined waits, keeping the loop's duties, until the events
// handed to the quarantine writer are stored, when Kafka transactions carry
// the progress: a boundary lets the sink commit a progress record past the
// transaction, and a crash after that commit but before the write would
// lose an event that is neither in Kafka nor in the quarantine table. In
// at-least-once mode the progress follows the tracker, which waits for
// the write anyway.
func (s *readLoop) awaitQuarantined(ctx context.Context) error {
	if !s.cfg.exactlyOnce {
		return nil
	}
	for s.quarantining > 0 {
		if _, err := s.wait(ctx, nil, nil); err != nil {
			return err
		}
		if err := s.duties(); err != nil {
			return err
		}
	}
	return nil
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

// publish builds and sends one outbox row, found at WAL position at. The
// row aliases the source's read buffer, which stays valid because nothing
// is received until it is sent.
func (s *readLoop) publish(ctx context.Context, row *replication.Row, at lsn.LSN) error {
	ev := &s.event
	*ev = eventOf(row, s.cfg.layout, s.txn, s.commitTime)
	ev.Position = uint64(at)
	var rec sink.Record
	var err error
	switch {
	case row.Unmapped != "" && row.ContentAt != 0: // a message's
		err = sink.BadContent(ev, row.Unmapped, row.ContentAt)
	case row.Unmapped != "":
		err = sink.UnmappedRow(ev, row.Unmapped, at)
	default:
		rec, err = s.build(ev)
	}
	var pending *sink.TopicPendingError
	if errors.As(err, &pending) {
		rec, err = s.awaitTopic(ctx, ev, pending)
	}
	if err != nil {
		var perr *sink.Error
		if !errors.As(err, &perr) || perr.Class != sink.ClassPermanent {
			return err
		}
		s.metrics.Failed(perr.Class)
		if s.quarantine == nil {
			return err
		}
		// Never sent: it is in flight until the quarantine table holds it,
		// so neither it nor anything after it is confirmed before that.
		s.tracker.Add(s.txn, 0)
		s.quarantining++
		q := store.QuarantinedEvent(ev, failure(perr))
		if row.Content != nil {
			// A message exists nowhere else: keep what the writer emitted,
			// for the operator and in case its values cannot be stored as
			// text. A copy: the content aliases the read buffer.
			q.Raw, q.RawLSN = bytes.Clone(row.Content), row.ContentAt
			q.ContentProblem = row.Unmapped
		}
		if d := row.Dropped; d != nil {
			// Dropped unread for its size: kept by reference only (a
			// table's row also stays in the table).
			q.RawSize, q.RawSHA256, q.RawLSN = d.Size, d.SHA256[:], at
			q.ContentProblem = row.Unmapped
		}
		s.quarantine.put(q, perr, s.txn, 0)
		return nil
	}
	s.tracker.Add(s.txn, rec.Size())
	return s.send(ctx, sink.Item{Record: rec})
}

// send hands an item to the sink, keeping the loop's duties while the sink
// is full.
func (s *readLoop) send(ctx context.Context, it sink.Item) error {
	select {
	case s.sink.Input() <- it:
		return nil
	default:
	}
	for {
		sent, err := s.wait(ctx, &it, nil)
		if sent || err != nil {
			return err
		}
		if err := s.duties(); err != nil {
			return err
		}
	}
}

// awaitTopic waits, keeping the loop's duties, while the sink looks up the
// event's topic. The event counts as in flight meanwhile: it is what holds
// the stream, and the admin endpoint should say so.
func (s *readLoop) awaitTopic(ctx context.Context, ev *event.Event, pending *sink.TopicPendingError) (sink.Record, error) {
	s.tracker.Add(s.txn, 0)
	defer s.tracker.Ack(s.txn, 0)
	for {
		if _, err := s.wait(ctx, nil, pending.Done); err != nil {
			return nil, err
		}
		if err := s.duties(); err != nil {
			return nil, err
		}
		select {
		case <-pending.Done:
		default:
			continue
		}
		rec, err := s.build(ev)
		if !errors.As(err, &pending) {
			return rec, err
		}
	}
}

// build checks the row's required values, then builds its record.
func (s *readLoop) build(ev *event.Event) (sink.Record, error) {
	if perr := sink.CheckRow(ev); perr != nil {
		return nil, perr
	}
	return s.sink.Build(ev)
}

// statusIfDue reports positions when the confirmed position moved and a
// StatusInterval passed (or idleConfirmDelay, once nothing is in flight),
// when keepaliveEvery passed, or when forced.
func (s *readLoop) statusIfDue(force bool) error {
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
	due := force || since >= s.keepaliveEvery ||
		moved && (since >= s.cfg.statusInterval || since >= idleConfirmDelay && s.tracker.Idle())
	if !due {
		return nil
	}
	if err := s.source.SendStatus(s.received, confirmed); err != nil {
		return err
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
	if retries := s.sink.Retries(); retries > s.retries {
		m.Retries.Add(float64(retries - s.retries))
		s.retries = retries
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

// drain ends a session on shutdown: stop reading, wait (bounded) for the
// outcomes of what is in flight, confirm what they allow, and close.
func (s *readLoop) drain() error {
	log := s.log
	// The state goes out as data: the relay's status reads it from the
	// report while its own says streaming.
	s.report.drain(time.Now())
	s.metrics.SetState(pipeline.StateDraining)
	deadline := s.clock.Now().Add(s.cfg.shutdownTimeout)
	if !s.finishBy.IsZero() {
		// Reading on to a commit already used part of the same timeout.
		deadline = s.finishBy
	}
	for s.tracker.Stats().InFlightEvents > 0 && s.clock.Now().Before(deadline) && s.failure == nil {
		if _, err := s.wait(context.Background(), nil, nil); err != nil {
			break
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
	s.close(err == nil)
	log.Info().Str("confirmed_lsn", s.flushedSent.String()).Msg("stopped cleanly")
	return err
}

// close ends the session's parts. A graceful close lets the server read
// the last status update before the connection goes.
func (s *readLoop) close(graceful bool) {
	s.timer.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if !graceful {
		ctx, cancel = context.WithCancel(ctx)
		cancel()
	}
	if err := s.source.Close(ctx); err != nil && graceful {
		s.log.Warn().Err(err).Msg("could not end the replication stream cleanly; the slot may be re-read from an earlier position")
	}
	if err := s.closeSink(s.sink, 5*time.Second); err != nil {
		s.log.Warn().Err(err).Msg("abandoned the session's producer")
	}
	if s.quarantine != nil {
		s.quarantine.stop()
	}
	s.closing.Wait()
}
