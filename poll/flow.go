package poll

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/engine"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/sink"
)

// flow is a session's side of the engine loop. It overlaps the session's
// three steps while a backlog drains: a claimer goroutine claims the next
// batch while the engine publishes one, and a marker goroutine marks a
// batch, on a connection of its own, while the next publishes. Done in
// turn, each step waited for the other two; PostgreSQL, the relay and
// Kafka were each idle two thirds of the time.
//
// Order needs nothing new. A batch claimed while an earlier one is still
// leased leaves out every row behind one of that batch's rows (the claim
// skips a row whose aggregate has an earlier row leased), so no aggregate
// is ever in two batches in flight; those rows are claimed once the
// earlier batch is marked.
//
// At most three batches are leased at once: one being marked, one
// publishing, one claimed and waiting for the engine. A waiting batch
// waits at most one publish, so a lease of two publishes (the least
// --poll-lease allows) covers the wait and its own publish.
type flow struct {
	w *worker
	// claimed takes the claimer's batches to the engine.
	claimed chan []claimed
	// toMark takes a settled batch to the marker.
	toMark chan markJob
	// settled gets one value per batch marked. The claimer reads it
	// whenever it waits for the flow.
	settled chan struct{}
	// failed holds the first failure of the claimer or the marker.
	failed chan error
	cancel context.CancelFunc
	// abandoned ends the marks under way once a connection is taken for
	// dead: the session ends, and waiting for them would keep it (and
	// its log line) up to their bound.
	abandoned context.Context
	abandon   context.CancelFunc
	done      sync.WaitGroup
	// claimerDone is closed once the claimer returned: nobody counts the
	// batches marked after that.
	claimerDone chan struct{}

	// The engine's side, on its goroutine alone: the batch it publishes
	// (nil: none), each row's result, and how many are still to settle.
	batch     []claimed
	results   []result
	unsettled int
	base      engine.Position // the position of the batch's first row
	next      engine.Position // base of the next batch
	events    []engine.Event  // reused for each batch's Read
}

// result is what became of one claimed row.
type result struct {
	acked       bool
	quarantined bool
	delivery    sink.Delivery
	err         *sink.Error
}

// markJob is a published batch and what became of each of its rows.
type markJob struct {
	rows    []claimed
	results []result
}

// startFlow starts the claimer and the marker; the engine reads the
// claimed batches through the flow, and Close ends both.
func (w *worker) startFlow(ctx context.Context, claimer func(ctx context.Context, f *flow) error) *flow {
	ctx, cancel := context.WithCancel(ctx)
	f := &flow{w: w, claimed: make(chan []claimed), toMark: make(chan markJob),
		settled: make(chan struct{}), failed: make(chan error, 1), cancel: cancel, claimerDone: make(chan struct{})}
	f.abandoned, f.abandon = context.WithCancel(context.Background())
	f.done.Add(2)
	go func() {
		defer f.done.Done()
		defer close(f.claimerDone)
		if err := claimer(ctx, f); err != nil && ctx.Err() == nil {
			f.fail(err)
		}
	}()
	go func() {
		defer f.done.Done()
		f.markStage(ctx)
	}()
	return f
}

// Next takes the next claimed batch, waiting until deadline at most.
func (f *flow) Next(ctx context.Context, deadline time.Time) (engine.Read, error) {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case rows := <-f.claimed:
		return f.start(rows)
	case err := <-f.failed:
		return engine.Read{}, err
	case <-timer.C:
	case <-ctx.Done():
	}
	return engine.Read{}, nil
}

// start makes a claimed batch the one the engine publishes. Each row's
// position is its index after base, carried as its event's Txn.
func (f *flow) start(rows []claimed) (engine.Read, error) {
	if err := f.claimsProved(); err != nil {
		// Its leases end with the claiming session.
		return engine.Read{}, err
	}
	f.base = f.next
	f.next += engine.Position(len(rows))
	f.batch, f.results = rows, make([]result, len(rows))
	f.events = f.events[:0]
	reclaimed := 0
	for i := range rows {
		r := &rows[i]
		if r.reclaimed {
			reclaimed++
		}
		if r.gone {
			continue // marked as gone with the batch
		}
		r.ev.Txn = f.base + engine.Position(i)
		e := engine.Event{Event: &r.ev, Attempts: r.attempts, Hold: r.aggKey}
		if limit := f.w.p.cfg.MaxMessageBytes; r.size > int64(limit) {
			oversize(&e, r.size, limit, leaseOversizeHeld(f.w.p.t))
		}
		f.events = append(f.events, e)
	}
	if reclaimed > 0 {
		p := f.w.p
		p.metrics.LeasesExpired.Add(float64(reclaimed))
		p.log.Warn().Int("rows", reclaimed).Msg("claimed rows whose lease had ended: their poller's session is gone, or it took longer than --poll-lease; it may have published them too (duplicates)")
	}
	f.unsettled = len(f.events)
	if f.unsettled == 0 {
		f.finish()
	}
	return engine.Read{Events: f.events, HoldAggregates: true}, nil
}

// Sent: a poller counts its batches, not their bytes.
func (f *flow) Sent(engine.Position, int) {}

// Settle keeps a row's result; once the batch's last one is in, the batch
// goes to the marker.
func (f *flow) Settle(pos engine.Position, fate engine.Fate) error {
	i := int(pos - f.base)
	res := &f.results[i]
	switch {
	case fate.Acked:
		res.acked, res.delivery = true, fate.Delivery
		f.w.p.metrics.observeAck(fate.Delivery, f.batch[i].insertedAt)
	case fate.Quarantined:
		res.quarantined, res.err = true, fate.Err
	case fate.Err != nil:
		res.delivery, res.err = fate.Delivery, fate.Err
	}
	if f.unsettled--; f.unsettled == 0 {
		now := time.Now()
		f.w.p.update(func(s *Status) { s.LastAckAt = &now })
		f.finish()
	}
	return nil
}

// finish hands the batch the engine settled to the marker.
func (f *flow) finish() {
	f.toMark <- markJob{rows: f.batch, results: f.results}
	f.batch, f.results = nil, nil
}

// Duties reports the claimer's or the marker's failure.
// While a batch publishes, it also stops the batch once its claiming
// session is unproven.
func (f *flow) Duties(bool) error {
	if err := f.failure(); err != nil {
		return err
	}
	if f.batch != nil {
		return f.claimsProved()
	}
	return nil
}

// ErrLeaseUnproven ends a lease poller's session that could not show its
// claiming session alive: PostgreSQL ends the leases of a session it
// noticed gone, within about --pg-timeout, and another poller may claim
// the rows.
var ErrLeaseUnproven = errors.New("the poller could not prove its claiming session alive")

// claimsProved says whether the claiming session answered within two
// thirds of --pg-timeout: the server cannot have noticed it gone, and
// released its leases, before --pg-timeout. The claimer proves it every
// third while a batch waits or publishes.
func (f *flow) claimsProved() error {
	p := f.w.p
	since := f.w.claimsAlive.since()
	if since < 2*p.proofEvery() {
		return nil
	}
	err := fmt.Errorf("%w: it last answered %s ago, and PostgreSQL releases its leases once it notices it gone (about --pg-timeout %s); publishing stops before another poller can claim the rows, taking the connection for dead and connecting again",
		ErrLeaseUnproven, since.Round(100*time.Millisecond), p.deadAfter())
	p.setState(pipeline.StateBackingOff, err)
	f.abandon()
	return err
}

// Wake: a poller has nothing to do on time (the claimer keeps the
// watchdog, and Next hears the claimer's and the marker's failures), but
// while a batch publishes the engine waits for outcomes and looks at
// Duties each second. Idle, it sleeps in Next: a wake-up a second cost
// 0.4 ms of CPU a second (the runtime's monitor spins after each).
func (f *flow) Wake() time.Time {
	if f.batch == nil {
		return time.Now().Add(time.Hour)
	}
	return time.Now().Add(time.Second)
}

// Full: one batch publishes at a time (see flow).
func (f *flow) Full() bool { return f.batch != nil }

// InTransaction: a batch is not a transaction; a stop sends no more of it.
func (f *flow) InTransaction() bool { return false }

// Close marks what the engine settled of its batch (the rest is given
// back), then ends the claimer and the marker.
func (f *flow) Close(bool) {
	if f.batch != nil {
		f.finish()
	}
	f.cancel()
	close(f.toMark)
	f.done.Wait()
	f.abandon()
}

// send hands a claimed batch to the engine, counting the batches marked
// meanwhile. If the flow fails or ctx ends first, the batch was never
// sent: its rows are given back.
func (f *flow) send(ctx context.Context, rows []claimed, inFlight *int) error {
	for {
		proof := proofTimer(f.w.claimsAlive)
		select {
		case f.claimed <- rows:
			proof.Stop()
			*inFlight++
			return nil
		case <-f.settled:
			*inFlight--
		case <-proof.C:
			// The engine publishes a batch only while the claiming
			// session is proved alive (see start): keep proving it.
			if err := f.w.claimsAlive.prove(ctx); err != nil {
				return err
			}
		case <-ctx.Done():
			proof.Stop()
			f.w.giveBack(ctx, rows)
			return nil
		}
		proof.Stop()
	}
}

// settle waits until every batch handed over is marked, ctx ends or other
// reports a failure.
func (f *flow) settle(ctx context.Context, inFlight *int, other <-chan error) error {
	for *inFlight > 0 {
		proof := proofTimer(f.w.claimsAlive)
		select {
		case <-f.settled:
			*inFlight--
		case <-proof.C:
			if err := f.w.claimsAlive.prove(ctx); err != nil {
				return err
			}
		case err := <-other:
			proof.Stop()
			return err
		case <-ctx.Done():
			proof.Stop()
			return nil
		}
		proof.Stop()
	}
	return nil
}

// markStage records each batch's results. The marks are written even when
// the session is ending: they record acks Kafka gave, and save their
// re-delivery.
//
// While no batch comes, it proves its connection alive; a mark, like a
// proof, is bounded: by --pg-timeout.
func (f *flow) markStage(ctx context.Context) {
	alive := f.w.marksAlive
	for {
		proof := proofTimer(alive)
		var job markJob
		var ok bool
		select {
		case job, ok = <-f.toMark:
		case <-proof.C:
			if err := alive.prove(ctx); err != nil {
				f.fail(err)
				for range f.toMark { // the session ends: nothing more is marked here
				}
				return
			}
			continue
		}
		proof.Stop()
		if !ok {
			return
		}
		err := alive.bounded(f.abandoned, f.w.p.deadAfter(), func(ctx context.Context) error {
			return f.w.mark(ctx, job.rows, job.results)
		})
		select {
		case f.settled <- struct{}{}:
		case <-f.claimerDone:
		}
		if err != nil {
			f.fail(err)
		}
	}
}

// fail keeps the first failure and stops the claimer.
func (f *flow) fail(err error) {
	if errors.Is(err, ErrConnectionDead) || errors.Is(err, ErrLeaseUnproven) {
		f.abandon()
	}
	select {
	case f.failed <- err:
	default:
	}
	f.cancel()
}

// failure reports a failure, if one happened, without waiting.
func (f *flow) failure() error {
	select {
	case err := <-f.failed:
		return err
	default:
		return nil
	}
}
