package relay

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
)

// Acks arrive in any order; the flush position may only pass a transaction
// once it and everything before it are acknowledged.
func TestLoopConfirmsInCommitOrder(t *testing.T) {
	rig := startLoop(t, rigOptions{})
	r1 := rig.txn(t, 2000, "e1")[0]
	r2 := rig.txn(t, 3000, "e2")[0]

	rig.sink.ack(r2)
	rig.turn(t)
	rig.source.noStatus(t, "the first transaction is unacknowledged")
	if got := rig.tracker.Confirmed(); got != rigStart {
		t.Fatalf("confirmed %v after acking only the second transaction, want %v", got, rigStart)
	}

	rig.sink.ack(r1)
	rig.turn(t)
	st := rig.source.nextStatus(t)
	if st.flushed != 3000 || st.written != 3000 {
		t.Fatalf("status flushed %v written %v, want both 3000", st.flushed, st.written)
	}
}

// A transactional sink gets one ordered stream: each source transaction's
// records, then its end with the progress record to write there. An
// at-least-once sink gets the records alone.
func TestLoopSendsEndsInWALOrderToATransactionalSink(t *testing.T) {
	rig := startLoop(t, rigOptions{delivery: DeliveryExactlyOnce})
	rig.reader.progress = txnProgress{topic: "outbox-relay.progress", key: []byte("s@1"), timeline: 1}.withRecord()
	rig.source.begin(t)
	var got []string
	take := func() {
		it := rig.sink.item(t)
		switch {
		case it.Record != nil:
			got = append(got, it.Record.EventID())
		case it.End != nil:
			if it.End.End != 2000 || it.End.Progress == nil || it.End.Progress.Topic != "outbox-relay.progress" {
				t.Fatalf("end %+v: want 2000 with its progress record", it.End)
			}
			got = append(got, "end")
		default:
			got = append(got, fmt.Sprintf("%+v", it))
		}
	}
	rig.source.row(t, "e1", "order")
	take()
	rig.source.row(t, "e2", "order")
	take()
	rig.source.commit(t, 2000)
	take()
	if strings.Join(got, ",") != "e1,e2,end" {
		t.Fatalf("the sink got %v, want the records, then the end", got)
	}

	alo := startLoop(t, rigOptions{})
	alo.txn(t, 2000, "e1")
	alo.txn(t, 3000, "e2")
	if alo.sink.ends != nil || alo.sink.flushes.Load() != 0 {
		t.Fatalf("an at-least-once sink got ends %v and %d flushes", alo.sink.ends, alo.sink.flushes.Load())
	}
}

// With nothing to do, the loop wakes every StatusInterval (its heartbeat)
// and reports status exactly at the keepalive interval.
func TestLoopStatusTiming(t *testing.T) {
	rig := startLoop(t, rigOptions{})
	t0 := rig.clock.Now()
	for i := 1; i <= 10; i++ {
		if got, want := rig.source.idle(t), t0.Add(time.Duration(i)*rigStatusInterval); !got.Equal(want) {
			t.Fatalf("read %d waited until %v, want %v", i, got.Sub(t0), want.Sub(t0))
		}
	}
	st := rig.source.nextStatus(t)
	if !st.at.Equal(t0.Add(rigKeepalive)) || st.flushed != rigStart {
		t.Fatalf("status at +%v flushed %v, want at +%v flushed %v", st.at.Sub(t0), st.flushed, rigKeepalive, rigStart)
	}
	if n := rig.alive.Load(); n < 10 {
		t.Fatalf("Alive called %d times in 10 heartbeats", n)
	}

	// A transaction acknowledged while idle is reported idleConfirmDelay
	// after the last update, not a StatusInterval later.
	r := rig.txn(t, 2000, "e1")[0]
	rig.sink.ack(r)
	rig.turn(t)
	st = rig.source.nextStatus(t)
	if want := t0.Add(rigKeepalive + idleConfirmDelay); st.flushed != 2000 || !st.at.Equal(want) {
		t.Fatalf("status flushed %v at +%v, want 2000 at +%v", st.flushed, st.at.Sub(t0), want.Sub(t0))
	}
}

// At the event bound the loop stops reading WAL, keeps its heartbeat and
// status updates, and reads again once a reported ack frees room.
func TestLoopBackpressureOnEvents(t *testing.T) {
	rig := startLoop(t, rigOptions{events: 2})
	t0 := rig.clock.Now()
	r1 := rig.txn(t, 2000, "e1")[0]
	rig.source.begin(t)
	rig.source.row(t, "e2", "order")
	rig.sink.sent(t)
	reads := rig.source.receives.Load()
	alive := rig.alive.Load()

	// Ten seconds of waiting at the bound: no read, a keepalive status.
	for rig.clock.Now().Before(t0.Add(rigKeepalive)) {
		rig.clock.advanceTo(rig.waiting(t))
	}
	rig.waiting(t)
	if got := rig.source.receives.Load(); got != reads {
		t.Fatalf("the loop read the stream %d times at the in-flight bound", got-reads)
	}
	if rig.alive.Load() <= alive {
		t.Fatal("Alive not called while waiting at the bound")
	}
	if st := rig.source.nextStatus(t); st.flushed != rigStart {
		t.Fatalf("status while full flushed %v, want %v", st.flushed, rigStart)
	}

	rig.sink.ack(r1)
	if st := rig.source.nextStatus(t); st.flushed != 2000 {
		t.Fatalf("status after the ack flushed %v, want 2000", st.flushed)
	}
	rig.source.commit(t, 3000) // reading again
}

// At the byte bound the loop stops reading, even inside a transaction, and
// goes on once an ack frees bytes.
func TestLoopBackpressureOnBytes(t *testing.T) {
	rig := startLoop(t, rigOptions{bytes: 1})
	rig.source.begin(t)
	rig.source.row(t, "e1", "order")
	r1 := rig.sink.sent(t)
	reads := rig.source.receives.Load()
	rig.clock.advanceTo(rig.waiting(t))
	rig.waiting(t)
	if got := rig.source.receives.Load(); got != reads {
		t.Fatalf("the loop read the stream %d times at the byte bound", got-reads)
	}
	rig.sink.ack(r1)
	rig.source.commit(t, 2000)
	rig.turn(t)
	if st := rig.source.nextStatus(t); st.flushed != 2000 {
		t.Fatalf("status flushed %v, want 2000", st.flushed)
	}
}

// On shutdown the loop stops reading, waits for the acks in flight,
// reports them, and ends the stream gracefully.
func TestLoopDrainsOnShutdown(t *testing.T) {
	rig := startLoop(t, rigOptions{})
	r1 := rig.txn(t, 2000, "e1")[0]
	rig.shutDown(t)
	rig.waiting(t) // draining: waiting for the ack
	rig.sink.ack(r1)
	if err := rig.end(t); err != nil {
		t.Fatalf("drain: %v", err)
	}
	if st := rig.source.nextStatus(t); st.flushed != 2000 {
		t.Fatalf("last status flushed %v, want 2000", st.flushed)
	}
	if graceful := <-rig.source.closed; !graceful {
		t.Fatal("the stream was not closed gracefully after a drain")
	}
	if !rig.sink.closed.Load() {
		t.Fatal("the sink was not closed")
	}
}

// The loop says it drains through its report, not by calling into the
// relay: a streaming relay whose loop drains shows draining in its status,
// /readyz and the state gauge, with no stall while it waits, and the next
// state the restart loop sets replaces it.
func TestLoopDrainShowsInTheRelayStatus(t *testing.T) {
	rig := startLoop(t, rigOptions{})
	r := rig.relay
	r.setStreaming(rig.tracker)
	r1 := rig.txn(t, 2000, "e1")[0]
	rig.shutDown(t)
	rig.waiting(t) // draining: waiting for the ack
	if st := r.Status(); st.State != pipeline.StateDraining || st.Since.IsZero() {
		t.Fatalf("state %q since %v while the loop drains, want draining", st.State, st.Since)
	}
	if ok, reason := r.Ready(); ok || reason != string(pipeline.StateDraining) {
		t.Fatalf("ready %v (%q) while draining", ok, reason)
	}
	if got := metricValue(t, r.metrics.State.WithLabelValues(string(pipeline.StateDraining))); got != 1 {
		t.Fatalf("draining state gauge %v, want 1", got)
	}
	if stalled, _ := r.kafkaStall(time.Now().Add(time.Hour)); stalled != 0 {
		t.Fatalf("a drain counted as a Kafka stall of %s", stalled)
	}
	rig.sink.ack(r1)
	if err := rig.end(t); err != nil {
		t.Fatalf("drain: %v", err)
	}
	r.setState(pipeline.StateStopped, nil)
	if st := r.Status(); st.State != pipeline.StateStopped {
		t.Fatalf("state %q after the restart loop stopped, want stopped", st.State)
	}
	r.setStreaming(lsn.NewTracker(rigStart, lsn.Limits{Events: 10}))
	if st := r.Status(); st.State != pipeline.StateStreaming {
		t.Fatalf("state %q in the next session, want streaming", st.State)
	}
}

// A drain that times out reports only what was acknowledged.
func TestLoopDrainTimesOut(t *testing.T) {
	rig := startLoop(t, rigOptions{})
	rig.txn(t, 2000, "e1")
	rig.shutDown(t)
	start := rig.clock.Now()
	for rig.clock.Now().Before(start.Add(rig.relay.cfg.ShutdownTimeout)) {
		rig.clock.advanceTo(rig.waiting(t))
	}
	if err := rig.end(t); err != nil {
		t.Fatalf("drain: %v", err)
	}
	for {
		st := rig.source.nextStatus(t)
		if st.flushed != rigStart {
			t.Fatalf("status flushed %v with the event unacknowledged, want %v", st.flushed, rigStart)
		}
		if len(rig.source.statuses) == 0 {
			break
		}
	}
}

// Every error class ends the session, and only those an operator must fix
// are fatal. Nothing of the failed transaction is confirmed.
func TestLoopEndsSessionOnEveryErrorClass(t *testing.T) {
	streamErr := errors.New("receive replication message: connection reset")
	for _, c := range []struct {
		name  string
		fail  func(rig *loopRig, r sink.Record)
		fatal bool
		want  error
	}{
		{name: "retriable", fail: func(rig *loopRig, r sink.Record) {
			rig.sink.fail(r, sink.ClassRetriable, sarama.ErrNotLeaderForPartition)
		}, want: sarama.ErrNotLeaderForPartition},
		{name: "sequence", fail: func(rig *loopRig, r sink.Record) {
			rig.sink.fail(r, sink.ClassProducer, sarama.ErrOutOfOrderSequenceNumber)
		}, want: sarama.ErrOutOfOrderSequenceNumber},
		{name: "epoch", fail: func(rig *loopRig, r sink.Record) {
			rig.sink.fail(r, sink.ClassProducer, sarama.ErrInvalidProducerEpoch)
		}, want: sarama.ErrInvalidProducerEpoch},
		{name: "permanent, halt", fail: func(rig *loopRig, r sink.Record) {
			rig.sink.fail(r, sink.ClassPermanent, sarama.ErrMessageSizeTooLarge)
		}, fatal: true, want: sarama.ErrMessageSizeTooLarge},
		{name: "auth", fail: func(rig *loopRig, r sink.Record) {
			rig.sink.fail(r, sink.ClassRetriable, fmt.Errorf("%w: SASL", sink.ErrAuth))
		}, fatal: true, want: sink.ErrAuth},
		{name: "stream", fail: func(rig *loopRig, _ sink.Record) {
			rig.source.steps <- sourceStep{err: streamErr}
		}, want: streamErr},
	} {
		t.Run(c.name, func(t *testing.T) {
			rig := startLoop(t, rigOptions{})
			r := rig.txn(t, 2000, "e1")[0]
			c.fail(rig, r)
			err := rig.untilEnd(t)
			if !errors.Is(err, c.want) {
				t.Fatalf("session ended with %v, want %v", err, c.want)
			}
			if IsFatal(err) != c.fatal {
				t.Fatalf("IsFatal(%v) = %t, want %t", err, IsFatal(err), c.fatal)
			}
			for len(rig.source.statuses) > 0 {
				if st := <-rig.source.statuses; st.flushed != rigStart {
					t.Fatalf("flushed %v past the failed transaction", st.flushed)
				}
			}
			if graceful := <-rig.source.closed; graceful {
				t.Fatal("a failed session's stream was closed as if drained")
			}
		})
	}
}

// A rejected record is quarantined off the loop, and counts as delivered
// only once stored: a later transaction acknowledged meanwhile is not
// confirmed past it.
func TestLoopQuarantineNeverReordersAcks(t *testing.T) {
	q := &fakeQuarantine{gate: make(chan struct{})}
	rig := startLoop(t, rigOptions{quarantine: q})
	r1 := rig.txn(t, 2000, "e1")[0]
	r2 := rig.txn(t, 3000, "e2")[0]
	rig.sink.fail(r1, sink.ClassPermanent, sarama.ErrMessageSizeTooLarge)
	rig.sink.ack(r2)
	rig.turn(t)
	rig.turn(t)
	rig.source.noStatus(t, "the quarantined event is not stored yet")

	close(q.gate)
	if e := <-q.stored; e.EventID != "e1" {
		t.Fatalf("stored %q, want e1", e.EventID)
	}
	rig.awaitFlushed(t, 3000)
	if got := counterValue(rig.relay.metrics.OrderBreaks.WithLabelValues("outbox.order", "0")); got != 0 {
		t.Fatalf("a rejected oversize record counted %v order breaks", got)
	}
}

// A quarantine write that fails stops the relay with an error that names
// the table and the fix, instead of retrying the same event for ever.
// Issue 40.2: the fix named grants whatever the cause; it follows the
// SQLSTATE now, and only a missing privilege is about grants.
func TestLoopQuarantineWriteFailureIsFatal(t *testing.T) {
	for _, c := range []struct {
		err       error
		want, not []string
	}{
		{&pgconn.PgError{Code: "42501", Message: "permission denied for table outbox_quarantine"},
			[]string{"GRANT", "SELECT, INSERT and UPDATE", "permission denied"}, []string{"migrate"}},
		{&pgconn.PgError{Code: "42703", Message: `column "raw" does not exist`},
			[]string{"migrate --print-sql", `column "raw"`}, []string{"grant"}},
		{&pgconn.PgError{Code: "22P05", Message: "unsupported Unicode escape sequence"},
			[]string{"bug of the relay"}, []string{"grant"}},
		{errors.New("conn closed"), []string{"reachable"}, []string{"grant"}},
	} {
		q := &fakeQuarantine{err: fmt.Errorf("quarantine event e1: %w", c.err)}
		rig := startLoop(t, rigOptions{quarantine: q})
		r := rig.txn(t, 2000, "e1")[0]
		rig.sink.fail(r, sink.ClassPermanent, sarama.ErrMessageSizeTooLarge)
		err := rig.untilEnd(t)
		if !errors.Is(err, pipeline.ErrQuarantineWrite) || !IsFatal(err) {
			t.Fatalf("ended with %v (fatal %t), want a fatal quarantine write error", err, IsFatal(err))
		}
		upper := strings.ToUpper(err.Error())
		for _, want := range append([]string{`"public"."outbox_quarantine"`, "e1"}, c.want...) {
			if !strings.Contains(upper, strings.ToUpper(want)) {
				t.Errorf("error %q does not mention %q", err, want)
			}
		}
		for _, not := range c.not {
			if strings.Contains(upper, strings.ToUpper(not)) {
				t.Errorf("error %q mentions %q", err, not)
			}
		}
	}
}

// An event refused before it is sent (here a NULL column) is quarantined,
// counted as a permanent publish error, and does not hold up the stream.
func TestLoopQuarantinesBeforeSending(t *testing.T) {
	q := &fakeQuarantine{}
	rig := startLoop(t, rigOptions{quarantine: q})
	rig.source.begin(t)
	var row replication.Row
	row.Values[replication.FieldEventID] = []byte("e-null")
	row.Values[replication.FieldAggregateType] = []byte("order")
	row.Values[replication.FieldEventType] = []byte("created")
	row.Values[replication.FieldPayload] = []byte(`{}`)
	rig.source.give(t, sourceStep{msg: &replication.Message{Kind: replication.KindRow, Row: row}})
	rig.source.commit(t, 2000)
	e := <-q.stored
	if e.EventID != "e-null" || e.Topic == "" || !strings.Contains(e.ErrorMessage, "NULL or empty aggregate_id") {
		t.Fatalf("stored %+v, want e-null with a NULL aggregate_id error and a topic that is not empty", e)
	}
	if got := counterValue(rig.relay.metrics.PublishErrors.WithLabelValues("permanent")); got != 1 {
		t.Fatalf("publish_errors_total{class=permanent} = %v, want 1", got)
	}
	rig.awaitFlushed(t, 2000)
	rig.txn(t, 3000, "e2")
}

// While a topic is looked up the loop keeps its heartbeat and status
// updates, counts the waiting event as in flight, and reads nothing else;
// once the topic is known missing the event is quarantined and the next
// one goes out.
func TestLoopKeepsDutiesWhileTopicIsLookedUp(t *testing.T) {
	q := &fakeQuarantine{}
	rig := startLoop(t, rigOptions{quarantine: q})
	lookup := make(chan struct{})
	rig.sink.lookups["outbox.missing"] = lookup
	t0 := rig.clock.Now()
	rig.source.begin(t)
	rig.source.row(t, "e1", "missing")
	reads := rig.source.receives.Load()
	alive := rig.alive.Load()
	for rig.clock.Now().Before(t0.Add(rigKeepalive)) {
		rig.clock.advanceTo(rig.waiting(t))
		if got := rig.tracker.Stats().InFlightEvents; got != 1 {
			t.Fatalf("in flight while the topic is looked up: %d, want 1", got)
		}
	}
	if got := rig.alive.Load() - alive; got < int64(rigKeepalive/idleConfirmDelay)-1 {
		t.Fatalf("Alive called %d times in 10 s of lookup, want one per wake", got)
	}
	if st := rig.source.nextStatus(t); !st.at.Equal(t0.Add(rigKeepalive)) {
		t.Fatalf("keepalive status at +%v, want +%v", st.at.Sub(t0), rigKeepalive)
	}
	if got := rig.source.receives.Load(); got != reads {
		t.Fatalf("the loop read the stream %d times while the event's topic was looked up", got-reads)
	}

	rig.sink.mu.Lock()
	rig.sink.missing["outbox.missing"] = true
	rig.sink.mu.Unlock()
	close(lookup)
	rig.source.row(t, "e2", "order")
	if r := rig.sink.sent(t); r.EventID() != "e2" {
		t.Fatalf("sent %s, want e2", r.EventID())
	}
	if e := <-q.stored; e.EventID != "e1" || e.Topic != "outbox.missing" {
		t.Fatalf("quarantined %+v, want e1 for outbox.missing", e)
	}
	if got := counterValue(rig.relay.metrics.PublishErrors.WithLabelValues("permanent")); got != 1 {
		t.Fatalf("publish_errors_total{class=permanent} = %v, want 1", got)
	}
}

// awaitFlushed lets the loop's reads time out until it reports want,
// while a quarantine write finishes on its own goroutine; keepalives at the
// start position may come meanwhile, anything else fails.
func (r *loopRig) awaitFlushed(t *testing.T, want lsn.LSN) {
	t.Helper()
	for {
		r.source.idle(t)
		select {
		case st := <-r.source.statuses:
			if st.flushed == want {
				return
			}
			if st.flushed != rigStart {
				t.Fatalf("flushed %v, want %v", st.flushed, want)
			}
		default:
		}
	}
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

// A stop that comes inside a transaction reads on to its commit, so the
// events of it already sent are confirmed and not sent again next time.
func TestLoopFinishesOpenTransactionOnShutdown(t *testing.T) {
	rig := startLoop(t, rigOptions{})
	rig.source.begin(t)
	rig.source.row(t, "e1", "order")
	r1 := rig.sink.sent(t)
	rig.cancel()
	rig.source.row(t, "e2", "order")
	r2 := rig.sink.sent(t)
	rig.source.commit(t, 2000)
	rig.waiting(t) // draining
	rig.sink.ack(r1)
	rig.sink.ack(r2)
	if err := rig.end(t); err != nil {
		t.Fatalf("drain: %v", err)
	}
	if st := rig.source.nextStatus(t); st.flushed != 2000 {
		t.Fatalf("last status flushed %v, want the open transaction's end 2000", st.flushed)
	}
}

// During a Kafka outage the replication connection stays: status updates
// go on, nothing more is read, the oldest unpublished event's age grows,
// and only once a producer connects again does the session end, cleanly,
// to re-stream from the confirmed position. It pins the issue where the
// session ended at once and the relay sat in "connecting" with the age at 0.
func TestLoopKeepsReplicationThroughKafkaOutage(t *testing.T) {
	rig := startLoop(t, rigOptions{recover: true})
	r1 := rig.txn(t, 2000, "e1")[0]
	rig.sink.ack(r1)
	r2 := rig.txn(t, 3000, "e2")[0]
	rig.kafkaDown.Store(true)
	rig.sink.fail(r2, sink.ClassRetriable, breaker.ErrBreakerOpen)
	rig.nudge(t) // the turn that takes the failure
	rig.waiting(t)
	reads := rig.source.receives.Load()
	outage := rig.clock.Now()
	for rig.clock.Now().Before(outage.Add(20 * time.Second)) {
		rig.clock.advanceTo(rig.waiting(t))
	}
	if got := rig.source.receives.Load(); got != reads {
		t.Fatalf("read the stream %d times while Kafka was down", got-reads)
	}
	keepalives := 0
	for len(rig.source.statuses) > 0 {
		st := <-rig.source.statuses
		if st.flushed != 2000 {
			t.Fatalf("status during the outage flushed %v, want 2000", st.flushed)
		}
		keepalives++
	}
	if keepalives < 2 {
		t.Fatalf("%d status updates in 20 s of outage, want one per keepalive interval", keepalives)
	}
	// The gauge is set with each status update, every keepalive interval.
	if age := gaugeValue(rig.relay.metrics.OldestUnpublished); age < rigKeepalive.Seconds() {
		t.Fatalf("oldest_unpublished_event_age_seconds = %v after 20 s of outage, want it to grow", age)
	}
	select {
	case err := <-rig.done:
		t.Fatalf("the session ended during the outage: %v", err)
	default:
	}

	rig.kafkaDown.Store(false)
	giveUp := time.After(patience)
	for {
		if due, waiting := rig.clock.armedUntil(); waiting {
			rig.clock.advanceTo(due) // the loop polls for the new producer
		}
		select {
		case <-rig.sinks:
			continue
		case err := <-rig.done:
			if !errors.Is(err, breaker.ErrBreakerOpen) || IsFatal(err) {
				t.Fatalf("session ended with %v, want the retriable Kafka failure", err)
			}
			if graceful := <-rig.source.closed; !graceful {
				t.Fatal("the stream was not ended cleanly once Kafka was back")
			}
			// Abandoned at the failure, it is closed there and only there:
			// sarama's client panicked on the second, concurrent close (a
			// drill's relay crashed with "close of closed channel").
			if n := rig.sink.closes.Load(); n != 1 {
				t.Fatalf("the failed sink was closed %d times, want once", n)
			}
			return
		case <-rig.clock.armed:
		case <-giveUp:
			t.Fatal("the session did not end once Kafka was back")
		}
	}
}

func gaugeValue(g prometheus.Gauge) float64 {
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		panic(err)
	}
	return m.GetGauge().GetValue()
}

// At the in-flight bound the loop asks the sink to commit: a transactional
// sink acks only after a commit, so waiting for acks without it would wait
// for the sink's interval, or for ever with a clock that does not move.
func TestLoopFlushesSinkAtTheBound(t *testing.T) {
	rig := startLoop(t, rigOptions{events: 2, delivery: DeliveryExactlyOnce})
	r1 := rig.txn(t, 2000, "e1")[0]
	if it := rig.sink.item(t); it.End == nil {
		t.Fatalf("after the first commit the loop sent %+v, want its end", it)
	}
	rig.source.begin(t)
	rig.source.row(t, "e2", "order")
	rig.sink.sent(t)
	if n := rig.sink.flushes.Load(); n != 0 {
		t.Fatalf("the loop flushed the sink %d times below the bound", n)
	}
	if it := rig.sink.item(t); !it.Flush {
		t.Fatalf("at the in-flight bound the loop sent %+v, want a flush", it)
	}
	for range 3 { // turns of the loop: one flush until an outcome comes
		rig.clock.advanceTo(rig.waiting(t))
	}
	rig.sink.nothingSent(t, "a second flush before any outcome")
	rig.sink.ack(r1)
	if st := rig.source.nextStatus(t); st.flushed != 2000 {
		t.Fatalf("status after the ack flushed %v, want 2000", st.flushed)
	}
}

// With Kafka transactions carrying the progress, a source transaction's
// boundary reaches the sink only once its quarantined events are stored:
// a commit of progress past an event still on its way to the quarantine
// table would lose it in a crash.
func TestLoopExactlyOnceEndsTxnAfterQuarantineStored(t *testing.T) {
	q := &fakeQuarantine{gate: make(chan struct{})}
	rig := startLoop(t, rigOptions{quarantine: q, delivery: DeliveryExactlyOnce})
	rig.sink.missing["outbox.poison"] = true
	rig.source.begin(t)
	rig.source.row(t, "e-poison", "poison")
	rig.source.row(t, "e-ok", "order")
	ok := rig.sink.sent(t)
	rig.source.commit(t, 2000)
	for range 3 { // turns of the loop: the boundary must not come
		rig.clock.advanceTo(rig.waiting(t))
	}
	rig.sink.nothingSent(t, "the transaction's boundary before its quarantined event was stored")
	q.gate <- struct{}{}
	if e := <-q.stored; e.EventID != "e-poison" {
		t.Fatalf("stored %s", e.EventID)
	}
	if it := rig.sink.item(t); it.End == nil || it.End.End != 2000 {
		t.Fatalf("after the quarantine write the loop sent %+v, want the boundary at 2000", it)
	}
	rig.sink.ack(ok)
	rig.awaitFlushed(t, 2000)
}

// With a read tick, the loop waits that long after a transaction's commit
// before it reads again, so transactions that arrive meanwhile are read and
// sent in one wake-up; it never waits while more is already buffered, nor
// inside a transaction.
func TestLoopGathersTransactionsAfterACommit(t *testing.T) {
	const tick = 2 * time.Millisecond
	rig := startLoop(t, rigOptions{readTick: tick})
	r1 := rig.txn(t, 2000, "e1")[0]
	committed := rig.clock.Now()
	due := rig.waiting(t)
	if want := committed.Add(tick); !due.Equal(want) {
		t.Fatalf("after a commit the loop waits until +%v, want +%v", due.Sub(committed), tick)
	}
	reads := rig.source.receives.Load()
	rig.sink.ack(r1)
	rig.waiting(t) // an outcome does not end the wait
	if got := rig.source.receives.Load(); got != reads {
		t.Fatalf("the loop read the stream %d times while gathering", got-reads)
	}
	rig.clock.advanceTo(due)
	rig.source.begin(t) // reading again once the tick passed
	rig.source.row(t, "e2", "order")
	r2 := rig.sink.sent(t)

	// More already read from the socket: no wait after the commit, the
	// next transaction is read at once on the same clock.
	rig.source.buffered.Store(true)
	rig.source.commit(t, 3000)
	rig.source.begin(t)
	if now := rig.clock.Now(); !now.Equal(due) {
		t.Fatalf("the loop waited %v with more buffered", now.Sub(due))
	}
	rig.source.row(t, "e3", "order")
	rig.sink.ack(r2)
	rig.sink.ack(rig.sink.sent(t))
	rig.source.buffered.Store(false)
	rig.source.commit(t, 4000)
	rig.clock.advanceTo(rig.waiting(t))
	rig.turn(t)
	if st := rig.source.nextStatus(t); st.flushed != 4000 {
		t.Fatalf("status flushed %v, want 4000", st.flushed)
	}
}

// A transaction committed long ago is a backlog being caught up on: no
// wait after it, even with nothing buffered.
func TestLoopDoesNotGatherWhileCatchingUp(t *testing.T) {
	rig := startLoop(t, rigOptions{readTick: 2 * time.Millisecond})
	rig.source.give(t, sourceStep{msg: &replication.Message{Kind: replication.KindBegin, CommitTime: rig.clock.Now().Add(-gatherMaxAge)}})
	rig.source.row(t, "e1", "order")
	rig.sink.sent(t)
	rig.source.commit(t, 2000)
	start := rig.clock.Now()
	rig.source.begin(t)
	if now := rig.clock.Now(); !now.Equal(start) {
		t.Fatalf("the loop waited %v after an old transaction", now.Sub(start))
	}
}

// Without a read tick (the setting's zero) the loop reads on at once after
// a commit.
func TestLoopReadsOnAtOnceWithoutReadTick(t *testing.T) {
	rig := startLoop(t, rigOptions{})
	rig.txn(t, 2000, "e1")
	start := rig.clock.Now()
	rig.source.begin(t)
	if now := rig.clock.Now(); !now.Equal(start) {
		t.Fatalf("the loop waited %v after a commit with no read tick", now.Sub(start))
	}
}
