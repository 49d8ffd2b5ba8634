package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// QuarantineWriter stores events the sink will never accept.
type QuarantineWriter interface {
	Put(ctx context.Context, e store.Quarantined) error
}

// quarantineJob is one event to store, with what to settle once it is
// stored.
type quarantineJob struct {
	event    store.Quarantined
	perr     *sink.Error
	pos      Position
	bytes    int
	attempts int
	// bound is the time its write was given.
	bound time.Duration
}

// quarantineFloorRate is the slowest link, in bytes a second, over which
// a quarantine write still finishes within its bound: beyond the base
// timeout, each row gets a second per this many bytes it writes. Measured:
// a 1 MB row over a link of 32 KB/s with 100 ms of latency took 33 s, and
// the fixed 30 s bound failed it, and the relay with it, every time.
const quarantineFloorRate = 8 << 10

// writeBound is how long the write of e may take: the base timeout plus
// its bytes at quarantineFloorRate.
func (q *Quarantiner) writeBound(e store.Quarantined) time.Duration {
	return q.timeout + time.Duration(quarantineBytes(e))*time.Second/quarantineFloorRate
}

// quarantineBytes is about what the write of e sends: its values, and its
// raw content when it keeps it.
func quarantineBytes(e store.Quarantined) int {
	return len(e.EventID) + len(e.AggregateType) + len(e.AggregateID) + len(e.EventType) + len(e.SchemaVersion) +
		len(e.Payload) + len(e.Headers) + len(e.OccurredAt) + len(e.Topic) + len(e.ErrorMessage) + len(e.ContentProblem) + len(e.Raw)
}

// quarantineAdvice says what to do about a failed write: for one that did
// not finish within its bound, what that means.
func quarantineAdvice(err error, job *quarantineJob) string {
	if !errors.Is(err, context.DeadlineExceeded) {
		return store.WriteAdvice(err)
	}
	return fmt.Sprintf("the write of about %d bytes did not finish within %s (30s, plus 1s per %d KB written): PostgreSQL was slower to reach than %d KB/s, or down or unreachable (a dead connection is noticed within --pg-timeout); check that it is up and that the link from the relay carries more than that, then start the relay again: it writes the event again",
		quarantineBytes(job.event), job.bound.Round(time.Second), quarantineFloorRate>>10, quarantineFloorRate>>10)
}

type quarantineResult struct {
	job *quarantineJob
	err error
}

// Quarantiner writes quarantined events on its own goroutine, one at a
// time, so the SQL never holds up the loop or the producer's acks. Results
// come back to the loop, in order. The loop stops it when its session ends.
type Quarantiner struct {
	table string // for the operator, in errors
	// storedMessage is what the log says of each event stored.
	storedMessage string
	writer        QuarantineWriter
	timeout       time.Duration
	jobs          chan *quarantineJob
	results       chan quarantineResult
	quit          chan struct{}
	done          sync.WaitGroup
	stopping      sync.Once
}

// NewQuarantiner starts a writer to table (named for the operator) that
// logs storedMessage for each event stored. capacity must exceed the
// events that can be in flight, so the loop never blocks handing over a
// job. Jobs go by pointer because a channel's buffer is allocated whole:
// by value, the exactly-once window's buffer took 14 MB, 43% of the live
// heap while catching up, for jobs that almost never come.
func NewQuarantiner(table string, w QuarantineWriter, capacity int, storedMessage string) *Quarantiner {
	q := &Quarantiner{
		table: table, writer: w, timeout: 30 * time.Second, storedMessage: storedMessage,
		jobs: make(chan *quarantineJob, capacity), results: make(chan quarantineResult, 1), quit: make(chan struct{}),
	}
	q.done.Add(1)
	go q.run()
	return q
}

func (q *Quarantiner) run() {
	defer q.done.Done()
	for job := range q.jobs {
		select {
		case <-q.quit:
			return
		default:
		}
		// Its own context: a stop still stores what is in flight. The
		// bound grows with what is written, so a slow but live link
		// finishes; a dead one is noticed sooner by TCP (--pg-timeout).
		job.bound = q.writeBound(job.event)
		ctx, cancel := context.WithTimeout(context.Background(), job.bound)
		err := q.writer.Put(ctx, job.event)
		cancel()
		select {
		case q.results <- quarantineResult{job, err}:
		case <-q.quit:
			return
		}
	}
}

// stop ends the writer once the write under way, if any, is done.
func (q *Quarantiner) stop() {
	q.stopping.Do(func() {
		close(q.quit)
		close(q.jobs)
	})
	q.done.Wait()
}

// Stop stops q when there is one: for a session that ends before its loop
// ran.
func (q *Quarantiner) Stop() {
	if q != nil {
		q.stop()
	}
}

// quarantine hands an event to the writer.
func (l *Loop) quarantine(e store.Quarantined, perr *sink.Error, pos Position, bytes, attempts int) {
	l.quarantining++
	job := &quarantineJob{event: e, perr: perr, pos: pos, bytes: bytes, attempts: attempts}
	if perr.OrderMayBreak {
		l.unstored = append(l.unstored, job)
	}
	l.cfg.Quarantine.jobs <- job
}

// stored takes a quarantine write's result: the event is settled as
// quarantined, or the session ends.
func (l *Loop) stored(res quarantineResult) {
	job, perr := res.job, res.job.perr
	l.quarantining--
	if res.err != nil {
		// It stays unstored: close counts it if it may break order.
		if l.failure == nil {
			l.failure = fmt.Errorf("%w %s: %w; %s; event %s (%v) stays unpublished until then",
				pipeline.ErrQuarantineWrite, l.cfg.Quarantine.table, res.err, quarantineAdvice(res.err, job), job.event.EventID, perr.Err)
		}
		return
	}
	if i := slices.Index(l.unstored, job); i >= 0 {
		l.unstored = slices.Delete(l.unstored, i, i+1)
	}
	l.inFlight--
	if err := l.settle(job.pos, Fate{Quarantined: true, Err: perr, Bytes: job.bytes}); err != nil {
		return
	}
	ev := l.log.Error().Str("event_id", job.event.EventID).Str("topic", job.event.Topic).Str("class", string(perr.Class))
	if job.attempts > 0 {
		ev = ev.Int("attempts", job.attempts)
	}
	ev.Err(perr.Err).Str("advice", perr.Advice()).Msg(l.cfg.Quarantine.storedMessage)
}
