package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// The simulator's fakes. The engine runs on its own goroutine as in the
// relay; every place where it can block is one of these, and each tells the
// simulator that the engine now waits (a note), so the simulator takes one
// step at a time, never while the engine runs. That is what makes a seed
// replay the same run: no select of the engine ever has two cases ready.

// simWake is how often the fake source asks to be woken. It is longer than
// simBackoffMax, so a pause for Kafka always waits out its backoff in one
// timer, and the simulator knows the next wake-up starts a new producer.
const (
	simWake       = time.Second
	simBackoffMin = 40 * time.Millisecond
	simBackoffMax = 320 * time.Millisecond
)

type noteKind int

const (
	noteNext  noteKind = iota // in Source.Next, waiting for a step
	noteArmed                 // in a select, with the timer armed
	noteEnded                 // Run returned
)

// simNote is what the engine waits on, as its fakes saw it.
type simNote struct {
	kind     noteKind
	deadline time.Time // noteNext
	due      time.Time // noteArmed
	// withItem: the select offers the sink an item; inPause: it is the
	// wait for Kafka, which reads no outcomes; lookup: it waits for the
	// topic's lookup; quarantining: jobs the quarantine writer has not
	// answered.
	withItem, inPause bool
	lookup            int // the aggregate whose topic it waits for, or -1
	quarantining      int
	err               error // noteEnded
}

func (n simNote) String() string {
	switch n.kind {
	case noteNext:
		return "reading"
	case noteArmed:
		s := "waiting"
		if n.withItem {
			s += " to send"
		}
		if n.inPause {
			s += " for kafka"
		}
		if n.lookup >= 0 {
			s += " for " + simTopic(n.lookup)
		}
		if n.quarantining > 0 {
			s += fmt.Sprintf(", %d quarantining", n.quarantining)
		}
		return s
	}
	return fmt.Sprintf("ended: %v", n.err)
}

// simClock is time that moves only when the simulator moves it.
type simClock struct {
	mu  sync.Mutex
	now time.Time
	// arm is told, on the engine's goroutine, each time a timer is armed
	// and does not fire at once; a session sets it before making its loop.
	arm    func(time.Duration)
	timers []*simTimer
}

func (c *simClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *simClock) NewTimer(time.Duration) pipeline.Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	// Created stopped: the loop stops its timer at once anyway, and arms
	// it only to wait.
	t := &simTimer{c: c, ch: make(chan time.Time, 1), arm: c.arm}
	c.timers = append(c.timers, t)
	return t
}

// advance moves time to at and fires what is due.
func (c *simClock) advance(at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if at.After(c.now) {
		c.now = at
	}
	for _, t := range c.timers {
		t.fireIfDue()
	}
}

type simTimer struct {
	c      *simClock
	ch     chan time.Time
	due    time.Time
	active bool
	arm    func(time.Duration)
}

func (t *simTimer) C() <-chan time.Time { return t.ch }

func (t *simTimer) Reset(d time.Duration) {
	t.c.mu.Lock()
	select {
	case <-t.ch:
	default:
	}
	t.due, t.active = t.c.now.Add(d), true
	fired := t.fireIfDue()
	t.c.mu.Unlock()
	if !fired && t.arm != nil {
		t.arm(d)
	}
}

func (t *simTimer) Stop() {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	t.active = false
}

// fireIfDue ticks a due timer; the clock's mu is held.
func (t *simTimer) fireIfDue() bool {
	if !t.active || t.due.After(t.c.now) {
		return false
	}
	t.active = false
	t.ch <- t.due
	return true
}

// simEvent is one committed outbox row.
type simEvent struct {
	id       string
	agg, seq int // aggregate, and place in its aggregate's commit order
	// refused: the source finds it unpublishable (a row it cannot map);
	// buildRefused: the sink cannot build it (a topic that does not
	// exist). Both hold until the operator fixes them (sim.fixed).
	refused, buildRefused bool
	attempts              int  // sends, every session
	acked                 bool // Kafka acknowledged it at least once
	quarantined           bool // the quarantine table holds it
	// It may first land after later events of its aggregate once a
	// failure that said order may break, or a hand-over to the
	// quarantine, came (sim.checkLogs).
	breakPushed, toQuarantine bool
}

type simTxn struct {
	events []*simEvent
	end    lsn.LSN
}

// simRead is one event as one session read it.
type simRead struct {
	ev    *simEvent
	pos   Position
	txnID lsn.TxnID
	end   lsn.LSN
	// heldBehind: read with HoldAggregates behind an event of its
	// aggregate that cannot be built, so it must not be sent.
	heldBehind  bool
	cannotBuild bool // Refused, or the sink refuses to build it
	unbuildable bool // the sink refuses to build it, as things stood when it was read

	sent       bool
	sentBytes  int
	toQuar     bool // Sent with 0 bytes: it goes to the quarantine
	received   bool // the sink got its record
	ackPushed  bool
	failPushed bool
	breaking   bool // a failure pushed for it said order may break
	unread     bool // its outcome was pushed while the engine read
	putOK      bool // the quarantine table stored it in this session
	settled    bool
	fate       Fate
}

func (r *simRead) answered() bool { return r.ackPushed || r.failPushed }

// simSource reads the world's committed transactions from a position, as a
// replication slot does, and makes positions durable through a real
// lsn.Tracker.
type simSource struct {
	s       *sim
	sess    *simSession
	tracker *lsn.Tracker
	busy    atomic.Bool

	closed       bool
	graceful     bool
	next         int // index of the next transaction to read
	inTxn        bool
	cur          int // index of the open transaction
	curEv        int // events of it read
	txnID        lsn.TxnID
	pos          Position
	reads        map[Position]*simRead
	ends         map[lsn.TxnID]lsn.LSN // of the transactions read whole
	byID         map[string]*simRead
	order        []*simRead
	lastEnd      lsn.LSN // end of the last transaction read whole
	inTxnAtClose bool
	broken       bool // the source failed: Next and Duties say so
	duties       int
	reported     lsn.LSN
	confirmed    lsn.LSN
}

var (
	errSourceBroken = errors.New("replication connection lost")
	errReread       = errors.New("read again from the durable position")
)

// enter flags a call that overlaps another or comes after Close: the
// engine promises to call its source from its own goroutine only.
func (src *simSource) enter(name string) func() {
	if !src.busy.CompareAndSwap(false, true) {
		src.s.violatef("Source.%s called while another call of the source runs", name)
	}
	if src.closed {
		src.s.violatef("Source.%s called after Close", name)
	}
	return func() { src.busy.Store(false) }
}

func (src *simSource) Next(ctx context.Context, deadline time.Time) (Read, error) {
	defer src.enter("Next")()
	s, sess := src.s, src.sess
	s.mu.Lock()
	if src.tracker.Full() {
		s.violatef("Next called while the source is full")
	}
	if ctx.Err() != nil {
		// After a stop the loop reads only on to the end of an open
		// transaction, for at most ShutdownTimeout.
		if !src.inTxn {
			s.violatef("Next called after the stop, outside a transaction")
		} else if s.clock.Now().After(sess.stopAt.Add(s.p.shutdown + simWake)) {
			s.violatef("still reading %v after the stop, past ShutdownTimeout %v", s.clock.Now().Sub(sess.stopAt), s.p.shutdown)
		}
	}
	broken := src.broken
	s.mu.Unlock()
	if broken {
		return Read{}, errSourceBroken
	}
	s.tell(simNote{kind: noteNext, deadline: deadline, quarantining: sess.loop.quarantining})
	var st simStep
	select {
	case st = <-sess.steps:
	case <-s.gone:
		return Read{}, errSourceBroken
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if st.advance > 0 {
		s.clock.advance(s.clock.Now().Add(st.advance))
	}
	switch st.kind {
	case stepFail:
		src.broken = true
		return Read{}, errSourceBroken
	case stepIdle:
		s.clock.advance(deadline)
		return Read{}, nil
	case stepKeepalive:
		s.clock.advance(deadline)
		if !src.inTxn {
			// The server's WAL end: past every transaction read or
			// skipped, before the next one ends.
			walEnd := simStart + 50
			if src.next > 0 {
				walEnd = s.txns[src.next-1].end + 50
			}
			src.tracker.ConfirmIdle(walEnd)
		}
		return Read{}, nil
	}
	if !src.inTxn {
		if src.next >= len(s.txns) {
			s.clock.advance(deadline) // nothing committed: nothing came
			return Read{}, nil
		}
		src.inTxn, src.cur, src.curEv = true, src.next, 0
		src.next++
		src.txnID = src.tracker.Open(s.clock.Now())
	}
	t := s.txns[src.cur]
	if src.curEv == len(t.events) {
		src.tracker.Close(src.txnID, t.end)
		src.inTxn, src.lastEnd = false, t.end
		src.ends[src.txnID] = t.end
		var rd Read
		if s.p.txnal {
			rd.End = &sink.SourceEnd{Txn: src.txnID, End: t.end, CommitTime: s.clock.Now()}
		}
		return rd, nil
	}
	var rd Read
	rd.HoldAggregates = st.hold
	cannot := map[int]bool{}
	for src.curEv < len(t.events) && len(rd.Events) < st.n {
		ev := t.events[src.curEv]
		src.curEv++
		src.pos++
		r := &simRead{ev: ev, pos: src.pos, txnID: src.txnID, end: t.end}
		r.cannotBuild = !s.fixed && (ev.refused || ev.buildRefused)
		r.unbuildable = !s.fixed && ev.buildRefused
		r.heldBehind = st.hold && cannot[ev.agg]
		if r.cannotBuild {
			cannot[ev.agg] = true
		}
		src.reads[r.pos], src.byID[ev.id] = r, r
		src.order = append(src.order, r)
		src.tracker.Add(src.txnID, 0)
		e := Event{Event: simEventOf(ev, r.pos), Hold: fmt.Sprint(ev.agg)}
		if s.p.counted {
			e.Attempts = ev.attempts + 1
		}
		if ev.refused && !s.fixed {
			e.Refused = &sink.Error{Class: sink.ClassPermanent, EventID: ev.id, Topic: "(not resolved)", Partition: -1,
				Err: errors.New("row cannot be mapped to an event")}
		}
		rd.Events = append(rd.Events, e)
	}
	s.tracef("  read %s%s", readIDs(rd.Events), map[bool]string{true: " (hold)"}[rd.HoldAggregates])
	return rd, nil
}

func readIDs(evs []Event) string {
	out := ""
	for i, e := range evs {
		if i > 0 {
			out += ","
		}
		out += string(e.EventID)
	}
	return out
}

func simEventOf(ev *simEvent, pos Position) *event.Event {
	return &event.Event{Txn: pos, EventID: []byte(ev.id), AggregateType: []byte("order"),
		AggregateID: []byte(fmt.Sprint("agg-", ev.agg)), EventType: []byte("changed"), Payload: []byte(fmt.Sprintf(`{"seq":%d}`, ev.seq))}
}

func (src *simSource) Sent(pos Position, bytes int) {
	defer src.enter("Sent")()
	s := src.s
	s.mu.Lock()
	defer s.mu.Unlock()
	r := src.reads[pos]
	switch {
	case r == nil:
		s.violatef("Sent(%d) of a position never read", pos)
		return
	case r.sent:
		s.violatef("Sent twice for %s", r.ev.id)
	case r.heldBehind:
		s.violatef("Sent for %s, held behind an event of its aggregate that cannot be built", r.ev.id)
	case r.settled:
		s.violatef("Sent for %s after it was settled (%s)", r.ev.id, fateString(r.fate))
	case bytes == 0 && !r.cannotBuild:
		s.violatef("%s goes to the quarantine although it can be built", r.ev.id)
	}
	r.sent, r.sentBytes, r.toQuar = true, bytes, bytes == 0
	src.built(pos)
	r.ev.attempts++
	if r.toQuar {
		r.ev.toQuarantine = true
	}
	src.tracker.Grow(bytes)
}

func (src *simSource) Settle(pos Position, f Fate) error {
	defer src.enter("Settle")()
	s := src.s
	s.mu.Lock()
	defer s.mu.Unlock()
	r := src.reads[pos]
	if r == nil {
		s.violatef("Settle(%d) of a position never read", pos)
		return nil
	}
	s.tracef("  settle %s: %s", r.ev.id, fateString(f))
	if r.settled {
		s.violatef("%s settled twice: %s, then %s", r.ev.id, fateString(r.fate), fateString(f))
		return nil
	}
	r.settled, r.fate = true, f
	src.built(pos)
	kinds := 0
	for _, k := range []bool{f.Acked, f.Quarantined, f.Unsent, f.Err != nil && !f.Quarantined} {
		if k {
			kinds++
		}
	}
	if kinds != 1 {
		s.violatef("%s settled with %d fates at once: %+v", r.ev.id, kinds, f)
	}
	if f.Bytes != r.sentBytes {
		s.violatef("%s settled with %d bytes, Sent said %d", r.ev.id, f.Bytes, r.sentBytes)
	}
	if r.heldBehind && !f.Unsent {
		s.violatef("%s, held behind an event of its aggregate that cannot be built, settled %s instead of unsent", r.ev.id, fateString(f))
	}
	switch {
	case f.Acked:
		if !r.ackPushed {
			s.violatef("%s settled acked, but the sink never acknowledged it", r.ev.id)
		}
		src.tracker.Ack(r.txnID, f.Bytes)
	case f.Quarantined:
		if !r.putOK {
			s.violatef("%s settled quarantined, but the quarantine table never stored it", r.ev.id)
		}
		src.tracker.Ack(r.txnID, f.Bytes)
	case f.Unsent:
		// It stays in the tracker, so nothing after it is confirmed. A
		// WAL-like source cannot skip it and go on with its aggregate's
		// later events: it ends the session and reads it again.
		return fmt.Errorf("%s not sent: %w", r.ev.id, errReread)
	case f.Err != nil:
		if !r.failPushed && !r.cannotBuild {
			s.violatef("%s settled failed (%v), but nothing failed it", r.ev.id, f.Err)
		}
		// A failure ends the session, as the WAL source's does.
		return f.Err
	}
	return nil
}

// built notes that the engine is done building the event at pos, whether
// it waited for the topic or not.
func (src *simSource) built(pos Position) {
	if k := src.sess.sink; k.building == pos {
		k.building = 0
	}
}

func fateString(f Fate) string {
	switch {
	case f.Acked:
		return "acked"
	case f.Quarantined:
		return "quarantined"
	case f.Unsent:
		return "unsent"
	case f.Err != nil:
		return "failed (" + string(f.Err.Class) + ")"
	}
	return "nothing"
}

func (src *simSource) Duties(force bool) error {
	defer src.enter("Duties")()
	s := src.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if src.broken {
		return errSourceBroken
	}
	src.duties++
	c := src.tracker.Confirmed()
	if force || src.tracker.Full() && c != src.reported || src.duties%3 == 0 {
		src.report(c)
	}
	return nil
}

// report makes c durable: the slot's flush position and the progress
// record, which the next session starts from. The caller holds s.mu.
func (src *simSource) report(c lsn.LSN) {
	s := src.s
	src.reported = c
	src.tracker.Reported(c)
	if src.sess.crashed {
		return // a crashed process reports nothing more
	}
	for _, t := range s.txns {
		if t.end > c {
			break
		}
		for _, ev := range t.events {
			if !ev.acked && !ev.quarantined {
				s.violatef("position %v made durable past %s, which Kafka never acknowledged nor the quarantine stored", c, ev.id)
			}
		}
	}
	if c != s.durable {
		s.durable = c
		s.saved = append(s.saved, c)
	}
}

func (src *simSource) Wake() time.Time { return src.s.clock.Now().Add(simWake) }

func (src *simSource) Full() bool { return src.tracker.Full() }

func (src *simSource) InTransaction() bool { return src.inTxn }

func (src *simSource) Close(graceful bool) {
	defer src.enter("Close")()
	s := src.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if graceful && !src.broken {
		src.report(src.tracker.Confirmed())
	}
	src.closed, src.graceful, src.inTxnAtClose = true, graceful, src.inTxn
	close(src.sess.closed)
}

// simRecord is a built record.
type simRecord struct {
	ev     *simEvent
	pos    Position
	size   int
	shaped event.Record
}

func (r *simRecord) Topic() string         { return simTopic(r.ev.agg) }
func (r *simRecord) EventID() string       { return r.ev.id }
func (r *simRecord) Size() int             { return r.size }
func (r *simRecord) Txn() uint64           { return r.pos }
func (r *simRecord) Shaped() *event.Record { return &r.shaped }
func (r *simRecord) partition() int32      { return 0 }

func simTopic(agg int) string { return fmt.Sprint("outbox.a", agg) }

type recState int

const (
	recPending recState = iota
	recAcked
	recFailed
)

// simRec is a record the sink received, and what became of it.
type simRec struct {
	rec      *simRecord
	read     *simRead
	state    recState
	doomed   bool // an earlier record of its aggregate failed cleanly
	appended bool // in the partition's log
	aborted  bool // its Kafka transaction aborted
	// lateOK: when the sink got it, its event could already land after
	// later ones of its aggregate (sim.checkLogs).
	lateOK bool
}

// simSink is a Kafka sink the simulator answers for. Its partitions'
// logs are the receive order of the records appended: acknowledged ones,
// and at its close those whose ack never came.
type simSink struct {
	s        *sim
	src      *simSource // of the session that made it
	id       int
	in       chan sink.Item
	outcomes chan sink.Outcome
	want     bool // Input was called since the timer was last armed; the engine's goroutine only
	closedCh chan struct{}
	// lookups are the topics (one an aggregate) still being looked up,
	// each until the simulator closes it; building is the position of the
	// event whose Build waits for one (the engine's goroutine only).
	lookups  map[int]chan struct{}
	building Position

	// Under s.mu:
	closes  int
	closed  bool
	settled bool // its close decided what it appended
	recs    []*simRec
	doomed  map[int]bool

	// A transactional sink's records wait in its open transaction, which
	// commits only after a source transaction's end or a flush (boundary);
	// a commit or an abort queues the outcomes to report, and after an
	// abort it commits nothing more.
	txnal    bool
	open     []*simRec
	boundary bool
	aborted  bool
	reports  []simReport
}

// simReport is an outcome a transactional sink owes: a record's, or, with
// rec nil, its transaction's end.
type simReport struct {
	rec       *simRec
	committed bool
}

func (s *sim) newSink() *simSink {
	k := &simSink{s: s, id: len(s.sinks), in: make(chan sink.Item), outcomes: make(chan sink.Outcome, 1024),
		closedCh: make(chan struct{}), doomed: map[int]bool{}, txnal: s.p.txnal}
	s.sinks = append(s.sinks, k)
	return k
}

func (k *simSink) Build(ev *event.Event) (sink.Record, error) {
	s := k.s
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.byID[string(ev.EventID)]
	if done := k.lookups[e.agg]; done != nil {
		select {
		case <-done:
		default:
			k.building = ev.Txn
			return nil, &sink.TopicPendingError{Topic: simTopic(e.agg), Done: done}
		}
	}
	k.building = 0
	if r := k.src.reads[ev.Txn]; r == nil || r.ev != e {
		s.violatef("Build of %s, which the source did not read at position %d", e.id, ev.Txn)
	} else if r.unbuildable {
		return nil, &sink.Error{Class: sink.ClassPermanent, EventID: e.id, Topic: "outbox.missing", Partition: -1,
			Err: errors.New("topic does not exist")}
	}
	r := &simRecord{ev: e, pos: ev.Txn}
	if err := event.Build(ev, &r.shaped); err != nil {
		return nil, fmt.Errorf("build %s: %w", e.id, err)
	}
	r.size = len(r.shaped.Key) + len(r.shaped.Value) + 40
	return r, nil
}

func (k *simSink) Input() chan<- sink.Item {
	k.want = true
	return k.in
}

func (k *simSink) Outcomes() <-chan sink.Outcome { return k.outcomes }
func (k *simSink) Retries() int64                { return 0 }

func (k *simSink) Close(time.Duration) error {
	s := k.s
	s.mu.Lock()
	defer s.mu.Unlock()
	k.closes++
	if k.closes > 1 {
		s.violatef("sink %d closed %d times (sarama's client panics on a second close)", k.id, k.closes)
	}
	if !k.closed {
		k.closed = true
		close(k.outcomes)
		close(k.closedCh)
	}
	return nil
}

// push reports an outcome; the caller holds s.mu.
func (k *simSink) push(o sink.Outcome) {
	if k.closed {
		return
	}
	k.outcomes <- o
}

// settleAppends decides, once the sink is gone (closed or its process
// crashed), what it appended of the records whose outcome never came:
// those before a record of their partition that was appended were
// appended too (Kafka keeps a partition's order), and each partition's
// unanswered tail is appended when tail says so. The caller holds s.mu.
func (k *simSink) settleAppends(tail func(agg int) bool) {
	if k.settled {
		return
	}
	k.settled = true
	if k.txnal {
		// What committed is in the log, reported or not; the rest was
		// never visible to a read_committed consumer.
		for _, r := range k.recs {
			if r.appended {
				k.s.inLog[r.rec.ev.id] = true
			}
		}
		return
	}
	last := map[int]int{}
	for i, r := range k.recs {
		if r.appended {
			last[r.rec.ev.agg] = i
		}
	}
	decided := map[int]bool{}
	for i, r := range k.recs {
		agg := r.rec.ev.agg
		if r.state != recPending || r.doomed {
			continue
		}
		if j, ok := last[agg]; ok && i < j {
			r.appended = true
			continue
		}
		if _, ok := decided[agg]; !ok {
			decided[agg] = tail(agg)
		}
		r.appended = decided[agg]
	}
	for _, r := range k.recs {
		if r.appended {
			k.s.inLog[r.rec.ev.id] = true
		}
	}
}

// simPut is one quarantine write waiting for the simulator.
type simPut struct {
	q     store.Quarantined
	reply chan error
}

// simQuarantine is a session's quarantine table writer: each Put waits for
// the simulator, or for the session's end.
type simQuarantine struct{ sess *simSession }

var errSessionClosed = errors.New("session closed")

func (q simQuarantine) Put(ctx context.Context, e store.Quarantined) error {
	p := &simPut{q: e, reply: make(chan error, 1)}
	select {
	case q.sess.puts <- p:
	case <-q.sess.closed:
		return errSessionClosed
	case <-q.sess.gone:
		return errSessionClosed
	}
	select {
	case err := <-p.reply:
		return err
	case <-q.sess.closed:
		return errSessionClosed
	case <-q.sess.gone:
		return errSessionClosed
	}
}

// simSinkCall is a NewSink call waiting for the simulator.
type simSinkCall struct {
	reply chan error
	sink  *simSink
}
