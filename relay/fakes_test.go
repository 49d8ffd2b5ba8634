package relay

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/eapache/go-resiliency/breaker"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/engine"
	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
)

// patience bounds every wait for the loop in these tests. The loop runs on
// fake time; this is only how long a test waits before calling it hung.
const patience = 10 * time.Second

// fakeClock is time that moves only when a test (or the fake source) moves
// it. Arming a timer is announced on armed, so a test can wait for the
// loop to wait and learn until when.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
	armed  chan struct{}
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 12, 1, 3, 0, 0, 0, time.UTC), armed: make(chan struct{}, 1)}
}

// armedUntil returns the due time of a timer armed and not yet fired.
func (c *fakeClock) armedUntil() (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, t := range c.timers {
		if t.active {
			return t.due, true
		}
	}
	return time.Time{}, false
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) NewTimer(d time.Duration) timer {
	// Created stopped: the loop resets its timer before each wait, and a
	// timer armed from the start would look like a wait to the test.
	t := &fakeTimer{clock: c, ch: make(chan time.Time, 1)}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.timers = append(c.timers, t)
	return t
}

// advanceTo moves time forward to at, firing the timers due by then.
func (c *fakeClock) advanceTo(at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if at.After(c.now) {
		c.now = at
	}
	for _, t := range c.timers {
		t.fireIfDue()
	}
}

type fakeTimer struct {
	clock  *fakeClock
	ch     chan time.Time
	due    time.Time
	active bool
}

func (t *fakeTimer) C() <-chan time.Time { return t.ch }

func (t *fakeTimer) Reset(d time.Duration) {
	c := t.clock
	c.mu.Lock()
	select {
	case <-t.ch:
	default:
	}
	t.due, t.active = c.now.Add(d), true
	t.fireIfDue()
	c.mu.Unlock()
	select {
	case c.armed <- struct{}{}:
	default:
	}
}

func (t *fakeTimer) Stop() {
	t.clock.mu.Lock()
	defer t.clock.mu.Unlock()
	t.active = false
}

// fireIfDue sends the tick of a due timer; the clock's mu is held.
func (t *fakeTimer) fireIfDue() {
	if t.active && !t.due.After(t.clock.now) {
		t.active = false
		t.ch <- t.due
	}
}

// fakeSource is a replication stream driven step by step by the test: each
// Receive takes one step, a message, an error, or "nothing came", which
// moves the fake clock to the deadline the loop asked for.
type fakeSource struct {
	clock    *fakeClock
	steps    chan sourceStep
	deadline chan time.Time // the deadline of each "nothing came" step
	statuses chan status
	receives atomic.Int64
	buffered atomic.Bool // what Buffered reports
	closed   chan bool   // true: closed gracefully
	msg      replication.Message
	// heard is when the fake server last sent something: a message, or
	// the answer a live server gives a ping at once. silent stops the
	// answers, as a connection black-holed in the network would.
	heard  time.Time
	silent atomic.Bool
}

type sourceStep struct {
	msg *replication.Message
	err error
}

type status struct {
	written, flushed lsn.LSN
	at               time.Time
}

func newFakeSource(c *fakeClock) *fakeSource {
	return &fakeSource{clock: c, steps: make(chan sourceStep), deadline: make(chan time.Time, 1024),
		statuses: make(chan status, 1024), closed: make(chan bool, 1), heard: c.Now()}
}

func (s *fakeSource) Receive(deadline time.Time) (*replication.Message, error) {
	s.receives.Add(1)
	step := <-s.steps
	switch {
	case step.err != nil:
		return nil, step.err
	case step.msg != nil:
		s.heard = s.clock.Now()
		s.msg = *step.msg
		return &s.msg, nil
	}
	s.clock.advanceTo(deadline)
	s.deadline <- deadline
	s.msg = replication.Message{Kind: replication.KindNone}
	return &s.msg, nil
}

func (s *fakeSource) Buffered() bool { return s.buffered.Load() }

func (s *fakeSource) SendStatus(written, flushed lsn.LSN, ping bool) error {
	if ping && !s.silent.Load() {
		s.heard = s.clock.Now()
	}
	s.statuses <- status{written, flushed, s.clock.Now()}
	return nil
}

func (s *fakeSource) Heard() time.Time { return s.heard }

func (s *fakeSource) Close(ctx context.Context) error {
	s.closed <- ctx.Err() == nil
	return nil
}

// give hands the loop's pending Receive one step.
func (s *fakeSource) give(t *testing.T, step sourceStep) {
	t.Helper()
	select {
	case s.steps <- step:
	case <-time.After(patience):
		t.Fatal("the loop did not read the stream")
	}
}

func (s *fakeSource) begin(t *testing.T) {
	t.Helper()
	s.give(t, sourceStep{msg: &replication.Message{Kind: replication.KindBegin, CommitTime: s.clock.Now()}})
}

func (s *fakeSource) row(t *testing.T, eventID, aggregateType string) {
	t.Helper()
	var row replication.Row
	row.Values[replication.FieldEventID] = []byte(eventID)
	row.Values[replication.FieldAggregateType] = []byte(aggregateType)
	row.Values[replication.FieldAggregateID] = []byte("agg-1")
	row.Values[replication.FieldEventType] = []byte("created")
	row.Values[replication.FieldSchemaVersion] = []byte("1")
	row.Values[replication.FieldPayload] = []byte(`{"n": 1}`)
	s.give(t, sourceStep{msg: &replication.Message{Kind: replication.KindRow, Row: row}})
}

func (s *fakeSource) commit(t *testing.T, end lsn.LSN) {
	t.Helper()
	s.give(t, sourceStep{msg: &replication.Message{Kind: replication.KindCommit, EndLSN: end}})
}

// txn streams one transaction of one event per id, ending at end, and
// returns the records the loop sent for it.
func (r *loopRig) txn(t *testing.T, end lsn.LSN, ids ...string) []sink.Record {
	t.Helper()
	r.source.begin(t)
	var recs []sink.Record
	for _, id := range ids {
		r.source.row(t, id, "order")
		recs = append(recs, r.sink.sent(t))
	}
	r.source.commit(t, end)
	return recs
}

// idle lets the loop's pending Receive time out and returns its deadline.
func (s *fakeSource) idle(t *testing.T) time.Time {
	t.Helper()
	s.give(t, sourceStep{})
	return <-s.deadline
}

// nextStatus returns the next status update sent.
func (s *fakeSource) nextStatus(t *testing.T) status {
	t.Helper()
	select {
	case st := <-s.statuses:
		return st
	case <-time.After(patience):
		t.Fatal("no status update sent")
		return status{}
	}
}

// noStatus fails if a status update was sent and not yet taken.
func (s *fakeSource) noStatus(t *testing.T, why string) {
	t.Helper()
	select {
	case st := <-s.statuses:
		t.Fatalf("%s: status sent: flushed %v at %v", why, st.flushed, st.at)
	default:
	}
}

// fakeSink is a Kafka sink the test answers for: records the loop sends
// arrive on sent, and the test reports outcomes with ack and fail.
type fakeSink struct {
	clock    *fakeClock
	in       chan sink.Item
	outcomes chan sink.Outcome
	retries  atomic.Int64
	closed   atomic.Bool
	closes   atomic.Int64 // calls of Close: a real sink's client panics on a second
	flushes  atomic.Int64 // flushes read

	mu      sync.Mutex
	lookups map[string]chan struct{} // topics being looked up
	missing map[string]bool          // topics that do not exist
	ends    []lsn.LSN                // ends of source transactions read
}

func newFakeSink(c *fakeClock) *fakeSink {
	return &fakeSink{clock: c, in: make(chan sink.Item), outcomes: make(chan sink.Outcome, 1024),
		lookups: map[string]chan struct{}{}, missing: map[string]bool{}}
}

func (k *fakeSink) Build(ev *event.Event) (sink.Record, error) {
	topic := "outbox." + string(ev.AggregateType)
	k.mu.Lock()
	defer k.mu.Unlock()
	if done, ok := k.lookups[topic]; ok {
		select {
		case <-done:
		default:
			return nil, &sink.TopicPendingError{Topic: topic, Done: done}
		}
	}
	if k.missing[topic] {
		return nil, &sink.Error{Class: sink.ClassPermanent, EventID: string(ev.EventID), Topic: topic, Partition: -1,
			Err: errors.New("topic does not exist")}
	}
	return publisher.BuildRecord(ev, topic)
}

func (k *fakeSink) Input() chan<- sink.Item       { return k.in }
func (k *fakeSink) Outcomes() <-chan sink.Outcome { return k.outcomes }
func (k *fakeSink) Retries() int64                { return k.retries.Load() }

// Close ends Outcomes, as a real sink does once it has drained; outcomes
// a test reports after that are dropped.
func (k *fakeSink) Close(time.Duration) error {
	k.closes.Add(1)
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.closed.Swap(true) {
		close(k.outcomes)
	}
	return nil
}

// item returns the next item the loop sent, noting ends and flushes.
func (k *fakeSink) item(t *testing.T) sink.Item {
	t.Helper()
	select {
	case it := <-k.in:
		k.mu.Lock()
		defer k.mu.Unlock()
		if it.End != nil {
			k.ends = append(k.ends, it.End.End)
		}
		if it.Flush {
			k.flushes.Add(1)
		}
		return it
	case <-time.After(patience):
		t.Fatal("the loop sent nothing to the sink")
		return sink.Item{}
	}
}

// sent returns the next record the loop sent, taking the ends and flushes
// before it.
func (k *fakeSink) sent(t *testing.T) sink.Record {
	t.Helper()
	for {
		if it := k.item(t); it.Record != nil {
			return it.Record
		}
	}
}

// nothingSent fails if the loop is handing the sink an item.
func (k *fakeSink) nothingSent(t *testing.T, why string) {
	t.Helper()
	select {
	case it := <-k.in:
		t.Fatalf("%s: the loop sent %+v", why, it)
	default:
	}
}

func (k *fakeSink) delivery(r sink.Record) sink.Delivery {
	return sink.Delivery{Txn: r.Txn(), Bytes: r.Size(), Topic: r.Topic(), Partition: 0, At: k.clock.Now()}
}

func (k *fakeSink) ack(r sink.Record) {
	k.report(sink.Outcome{Delivery: k.delivery(r)})
}

func (k *fakeSink) fail(r sink.Record, class sink.Class, err error) {
	d := k.delivery(r)
	// As the Kafka sink says of these errors: a record that reached a
	// partition may break its order, unless it was never sent (the
	// breaker) or Kafka refused it for good.
	mayBreak := class != sink.ClassPermanent && !errors.Is(err, breaker.ErrBreakerOpen)
	k.report(sink.Outcome{Delivery: d, Err: &sink.Error{Class: class, EventID: r.EventID(),
		Topic: d.Topic, Partition: d.Partition, Err: err, Record: r, OrderMayBreak: mayBreak}})
}

func (k *fakeSink) report(o sink.Outcome) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.closed.Load() {
		k.outcomes <- o
	}
}

// fakeQuarantine stores events in memory; gate, when set, holds each Put
// until the test lets it through, and err makes every Put fail.
type fakeQuarantine struct {
	gate   chan struct{}
	err    error
	stored chan Quarantined
}

func (q *fakeQuarantine) Put(ctx context.Context, e Quarantined) error {
	if q.gate != nil {
		select {
		case <-q.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if q.err != nil {
		return q.err
	}
	q.stored <- e
	return nil
}

// loopRig is a read loop over fakes, running in its own goroutine.
type loopRig struct {
	relay     *Relay
	clock     *fakeClock
	source    *fakeSource
	sink      *fakeSink
	tracker   *lsn.Tracker
	reader    *walReader
	loop      *engine.Loop
	cancel    context.CancelFunc
	done      chan error
	sinks     chan *fakeSink // sinks made after a Kafka failure
	kafkaDown atomic.Bool    // new sinks cannot be made
	alive     atomic.Int64
}

type rigOptions struct {
	// recover: after a Kafka failure the loop waits, replication kept,
	// until a new sink can be made (each is sent on loopRig.sinks).
	recover    bool
	events     int
	bytes      int64
	quarantine *fakeQuarantine // nil: halt on permanent errors
	delivery   string          // the relay's --delivery; empty: the default
	readTick   time.Duration
}

const (
	rigStatusInterval = time.Second
	rigKeepalive      = 10 * time.Second
	rigStart          = lsn.LSN(1000)
)

func startLoop(t *testing.T, o rigOptions) *loopRig {
	t.Helper()
	if o.events == 0 {
		o.events = 100
	}
	if o.bytes == 0 {
		o.bytes = 1 << 20
	}
	cfg := DefaultConfig()
	cfg.StatusInterval, cfg.StatusMaxInterval = rigStatusInterval, rigKeepalive
	cfg.MaxInFlightEvents, cfg.MaxInFlightBytes = o.events, o.bytes
	cfg.ShutdownTimeout = 30 * time.Second
	if o.delivery != "" {
		cfg.Delivery = o.delivery
	}
	cfg.ReadTick = o.readTick
	rig := &loopRig{clock: newFakeClock(), done: make(chan error, 1), sinks: make(chan *fakeSink, 4)}
	rig.relay = New(cfg, zerolog.Nop(), nil, Hooks{Alive: func() { rig.alive.Add(1) }})
	rig.source, rig.sink = newFakeSource(rig.clock), newFakeSink(rig.clock)
	rig.tracker = lsn.NewTracker(rigStart, lsn.Limits{Events: o.events, Bytes: o.bytes})
	rig.tracker.UseClock(rig.clock.Now)
	var q *engine.Quarantiner
	if o.quarantine != nil {
		if o.quarantine.stored == nil {
			o.quarantine.stored = make(chan Quarantined, 100)
		}
		q = engine.NewQuarantiner(`"public"."outbox_quarantine"`, o.quarantine, o.events+2, quarantineStored)
	}
	rig.relay.clock = rig.clock
	rig.reader = newWALReader(rig.relay.loopEnv(), rig.source, rig.tracker, rigStart, rigKeepalive, newLiveness(0, 0, rigKeepalive))
	var newSink func() (sink.Sink, error)
	if o.recover {
		newSink = func() (sink.Sink, error) {
			if rig.kafkaDown.Load() {
				return nil, errors.New("connect to kafka brokers: connection refused")
			}
			k := newFakeSink(rig.clock)
			rig.sinks <- k
			return k, nil
		}
	}
	rig.loop = engine.New(rig.relay.engineConfig(rig.reader, q, newSink), rig.reader, rig.sink)
	rig.reader.takeRetries = rig.loop.TakeRetries
	ctx, cancel := context.WithCancel(context.Background())
	rig.cancel = cancel
	go func() { rig.done <- rig.loop.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-rig.done:
		case <-time.After(100 * time.Millisecond):
			// Still blocked on a fake step the test never gave; the test
			// already failed or asserted what it needed.
		}
	})
	return rig
}

// end waits for the loop to finish and returns its error.
func (r *loopRig) end(t *testing.T) error {
	t.Helper()
	select {
	case err := <-r.done:
		return err
	case <-time.After(patience):
		t.Fatal("the loop did not end")
		return nil
	}
}

// turn lets the loop finish a whole turn with nothing read: outcomes
// taken, status decided, back at the stream.
func (r *loopRig) turn(t *testing.T) {
	t.Helper()
	r.source.idle(t)
	r.source.idle(t)
}

// untilEnd lets the loop's reads time out until it ends, and returns its
// error: for endings that come from another goroutine.
func (r *loopRig) untilEnd(t *testing.T) error {
	t.Helper()
	deadline := time.After(patience)
	for {
		select {
		case err := <-r.done:
			return err
		case r.source.steps <- sourceStep{}:
			<-r.source.deadline
		case <-deadline:
			t.Fatal("the loop did not end")
			return nil
		}
	}
}

// shutDown cancels the loop's context and lets a pending read return, so
// the loop notices and starts draining.
func (r *loopRig) shutDown(t *testing.T) {
	t.Helper()
	r.cancel()
	r.nudge(t)
}

// nudge lets a pending read return, unless the loop is waiting in its own
// select, so it notices what changed.
func (r *loopRig) nudge(t *testing.T) {
	t.Helper()
	deadline := time.After(patience)
	for {
		if _, ok := r.clock.armedUntil(); ok {
			return // waiting: it will see ctx or is draining
		}
		select {
		case r.source.steps <- sourceStep{}:
			<-r.source.deadline
			return
		case <-r.clock.armed:
		case err := <-r.done:
			r.done <- err
			return
		case <-deadline:
			t.Fatal("the loop neither read nor waited")
		}
	}
}

// waiting returns once the loop has armed its timer to wait in its own
// select, and until when. Advancing the clock to that time wakes it.
func (r *loopRig) waiting(t *testing.T) time.Time {
	t.Helper()
	deadline := time.After(patience)
	for {
		if due, ok := r.clock.armedUntil(); ok {
			return due
		}
		select {
		case <-r.clock.armed:
		case <-deadline:
			t.Fatal("the loop did not wait")
			return time.Time{}
		}
	}
}
