package poll

import (
	"context"
	"sync"
)

// flow overlaps a session's three steps while a backlog drains: the
// session claims the next batch while one publishes, and a batch is
// marked, on a connection of its own, while the next publishes. Done in
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
// publishing, one claimed and waiting for the publisher. A waiting batch
// waits at most one publish, so a lease of two publishes (the least
// --poll-lease allows) covers the wait and its own publish.
type flow struct {
	w         *worker
	toPublish chan []claimed
	toMark    chan markJob
	// settled gets one value per batch marked. The claimer reads it
	// whenever it waits for the flow, and stop reads what is left.
	settled chan struct{}
	// failed holds the first failure of a stage.
	failed   chan error
	cancel   context.CancelFunc
	done     chan struct{}
	inFlight int // batches sent and not settled; the claiming goroutine's alone
}

// markJob is a published batch and what became of each of its rows.
type markJob struct {
	rows    []claimed
	results []result
}

// startFlow starts the publish and mark stages; the caller claims, hands
// batches over with send, and ends the flow with stop.
func (w *worker) startFlow(ctx context.Context) *flow {
	ctx, cancel := context.WithCancel(ctx)
	f := &flow{w: w, toPublish: make(chan []claimed), toMark: make(chan markJob),
		settled: make(chan struct{}, 1), failed: make(chan error, 1), cancel: cancel, done: make(chan struct{})}
	var stages sync.WaitGroup
	stages.Add(2)
	go func() {
		defer stages.Done()
		defer close(f.toMark)
		f.publishStage(ctx)
	}()
	go func() {
		defer stages.Done()
		f.markStage(ctx)
	}()
	go func() {
		stages.Wait()
		close(f.done)
	}()
	return f
}

// publishStage publishes each batch handed over, then hands it to the
// mark stage. A batch it could not send goes there with no results, and
// its rows are given back.
func (f *flow) publishStage(ctx context.Context) {
	for rows := range f.toPublish {
		results, err := f.w.publish(ctx, rows)
		if err != nil {
			f.fail(err)
			results = make([]result, len(rows))
		}
		f.toMark <- markJob{rows: rows, results: results}
	}
}

// markStage records each batch's results. The marks are written even when
// the session is ending: they record acks Kafka gave, and save their
// re-delivery.
func (f *flow) markStage(ctx context.Context) {
	for job := range f.toMark {
		markCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markTimeout)
		err := f.w.mark(markCtx, job.rows, job.results)
		cancel()
		f.settled <- struct{}{}
		if err != nil {
			f.fail(err)
		}
	}
}

// fail keeps a stage's first failure and stops the flow: the publisher
// sends no more, and what is left is given back.
func (f *flow) fail(err error) {
	select {
	case f.failed <- err:
	default:
	}
	f.cancel()
}

// send hands a claimed batch to the publish stage. If the flow fails or
// ctx ends first, the batch was never sent: its rows are given back.
func (f *flow) send(ctx context.Context, rows []claimed) error {
	for {
		select {
		case f.toPublish <- rows:
			f.inFlight++
			return nil
		case <-f.settled:
			f.inFlight--
		case err := <-f.failed:
			f.w.giveBack(ctx, rows)
			return err
		case <-ctx.Done():
			f.w.giveBack(ctx, rows)
			return nil
		}
	}
}

// settle waits until every batch handed over is marked, the flow fails,
// ctx ends (nil) or other reports a failure.
func (f *flow) settle(ctx context.Context, other <-chan error) error {
	for f.inFlight > 0 {
		select {
		case <-f.settled:
			f.inFlight--
		case err := <-f.failed:
			return err
		case err := <-other:
			return err
		case <-ctx.Done():
			return nil
		}
	}
	return nil
}

// failure reports a stage's failure, if one happened, without waiting.
func (f *flow) failure() error {
	select {
	case err := <-f.failed:
		return err
	default:
		return nil
	}
}

// stop ends the flow and waits for its stages: the batch publishing stops
// sending and waits up to the shutdown timeout for what is in flight, then
// every batch is marked or given back.
func (f *flow) stop() {
	f.cancel()
	close(f.toPublish)
	for {
		select {
		case <-f.settled: // nobody counts them now; the mark stage must not wait
		case <-f.done:
			return
		}
	}
}
