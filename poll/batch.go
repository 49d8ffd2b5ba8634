package poll

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/internal/backoff"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// worker runs one session's claims, publishes and marks. Its claims use
// one connection and its marks another, so that a mark never waits for a
// claim (see flow).
type worker struct {
	p          *Poller
	claims     *queries
	marks      *queries
	pub        sink.Sink
	quarantine *store.Quarantine
}

// result is what became of one claimed row in Kafka.
type result struct {
	acked    bool
	delivery sink.Delivery
	err      *sink.Error
}

// markTimeout bounds the marks written after the context ended, so a stop
// still records the acks it got.
const markTimeout = 10 * time.Second

// claim leases the next batch.
func (w *worker) claim(ctx context.Context) ([]claimed, error) {
	rows, err := w.claims.claimBatch(ctx, w.p.cfg.Batch, w.p.cfg.Lease)
	now := time.Now()
	w.p.update(func(s *Status) { s.LastClaimAt = &now })
	if err != nil {
		return nil, err
	}
	w.p.metrics.observeClaim(len(rows))
	return rows, nil
}

// giveBack releases claimed rows that were never sent, without counting
// an attempt, rather than leave them leased until this poller's next
// session or the lease's end. It runs after a stop too.
func (w *worker) giveBack(ctx context.Context, rows []claimed) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markTimeout)
	defer cancel()
	seqs := make([]int64, len(rows))
	for i := range rows {
		seqs[i] = rows[i].seq
	}
	if err := w.claims.release(ctx, seqs); err != nil {
		w.p.log.Warn().Str("error", err.Error()).Int("rows", len(seqs)).Msg("could not give back an unsent batch; its rows wait for this poller's next session or their lease's end")
	}
}

// publish sends the batch's records in claim order and collects every
// outcome; on a stop it waits up to the shutdown timeout for them.
func (w *worker) publish(ctx context.Context, rows []claimed) ([]result, error) {
	results := make([]result, len(rows))
	var reclaimed int
	// An event that cannot be built holds back the rest of its aggregate
	// in this batch: they are not sent, and go again after it.
	refused := map[string]bool{}
	// Outcomes come back in any order; each finds its row by its record.
	rowOf := make(map[sink.Record]int, len(rows))
	for i := range rows {
		r := &rows[i]
		if r.reclaimed {
			reclaimed++
		}
		if r.gone || refused[r.aggKey] {
			continue
		}
		rec, err := buildRecord(ctx, w.pub, &r.ev)
		if err != nil {
			var perr *sink.Error
			if !errors.As(err, &perr) {
				return nil, err // ctx ended, or the producer must restart (a topic takes smaller batches)
			}
			results[i].err = perr
			refused[r.aggKey] = true
			continue
		}
		r.record = rec
		rowOf[rec] = i
	}
	if reclaimed > 0 {
		w.p.metrics.LeasesExpired.Add(float64(reclaimed))
		w.p.log.Warn().Int("rows", reclaimed).Msg("claimed rows whose lease had ended: their poller's session is gone, or it took longer than --poll-lease; it may have published them too (duplicates)")
	}
	outstanding := 0
	apply := func(o sink.Outcome) {
		outstanding--
		i := rowOf[o.Record]
		results[i].delivery = o.Delivery
		if o.Err != nil {
			results[i].err = o.Err
			return
		}
		results[i].acked = true
		w.p.metrics.observeAck(o.Delivery, rows[i].insertedAt)
	}
	stopping := ctx.Done()
	var deadline <-chan time.Time
	for i := 0; i < len(rows) || outstanding > 0; {
		var input chan<- sink.Item
		var item sink.Item
		for i < len(rows) && rows[i].record == nil {
			i++
		}
		if i < len(rows) {
			input, item = w.pub.Input(), sink.Item{Record: rows[i].record}
		} else if outstanding == 0 {
			break
		}
		select {
		case input <- item:
			outstanding++
			i++
		case o := <-w.pub.Outcomes():
			apply(o)
		case <-stopping:
			// Send no more; wait a while for what is in flight.
			stopping = nil
			for ; i < len(rows); i++ {
				rows[i].record = nil
			}
			timer := time.NewTimer(w.p.cfg.ShutdownTimeout)
			defer timer.Stop()
			deadline = timer.C
		case <-deadline:
			return results, nil
		}
	}
	if outstanding == 0 {
		now := time.Now()
		w.p.update(func(s *Status) { s.LastAckAt = &now })
	}
	return results, nil
}

// mark records the batch's results. Within the batch, once a row of an
// aggregate failed, its later rows are not marked even when Kafka acked
// them: they go again after it, so the last delivery is in order (the
// first was not: the failed row counts as one order break, however many
// later rows passed it). Rows with no result (a stop)
// are released to be claimed again.
func (w *worker) mark(ctx context.Context, rows []claimed, results []result) error {
	cfg := w.p.cfg
	var published, released, gone []int64
	var failures []failure
	var halt error
	blocked := map[string]bool{}
	broken := map[string]bool{} // aggregates whose failure later rows passed
	failed := 0
	var firstFailure *sink.Error
	for i := range rows {
		r, res := &rows[i], results[i]
		switch {
		case r.gone:
			gone = append(gone, r.seq)
			w.p.log.Error().Str("event_id", r.eventID).Int64("seq", r.seq).
				Msg("the outbox row was deleted before it was published: it cannot be published; find out what deletes unpublished outbox rows")
			w.p.metrics.RowsGone.Inc()
			continue
		case blocked[r.aggKey]:
			if res.acked && !broken[r.aggKey] {
				broken[r.aggKey] = true
				w.p.metrics.OrderBroke(res.delivery.Topic, res.delivery.Partition)
			}
			released = append(released, r.seq)
			continue
		case res.acked:
			published = append(published, r.seq)
			continue
		case res.err == nil: // never sent, or no answer before a stop
			blocked[r.aggKey] = true
			released = append(released, r.seq)
			continue
		}
		blocked[r.aggKey] = true
		failed++
		if firstFailure == nil {
			firstFailure = res.err
		}
		class := res.err.Class
		w.p.metrics.Failed(class)
		switch {
		case class == sink.ClassPermanent && cfg.OnPermanentError == pipeline.OnPermanentHalt:
			failures = append(failures, failure{seq: r.seq, delay: cfg.BackoffMin, class: string(class), msg: res.err.Error()})
			if halt == nil {
				halt = fmt.Errorf("%w: %s (--on-permanent-error halt); %s", errHalted, res.err.Error(), res.err.Advice())
			}
		case class == sink.ClassPermanent || r.attempts >= cfg.MaxAttempts:
			if err := w.quarantineRow(ctx, r, res.err); err != nil {
				return err
			}
		default:
			failures = append(failures, failure{seq: r.seq, delay: backoff.Delay(cfg.BackoffMin, cfg.BackoffMax, r.attempts),
				class: string(class), msg: res.err.Error()})
		}
	}
	if err := w.marks.markPublished(ctx, published); err != nil {
		return err
	}
	if err := w.marks.forgetGone(ctx, gone); err != nil {
		return err
	}
	if err := w.marks.markFailed(ctx, failures); err != nil {
		return err
	}
	if err := w.marks.release(ctx, released); err != nil {
		return err
	}
	if failed > 0 {
		w.p.log.Warn().Int("failed", failed).Int("published", len(published)).Int("held_back", len(released)).
			Str("first_error", firstFailure.Error()).Str("advice", firstFailure.Advice()).
			Msg("Kafka failed records of a batch; each backs off on its own, and the later events of its aggregate wait for it")
	}
	if halt != nil {
		return halt
	}
	if firstFailure != nil && firstFailure.Class == sink.ClassProducer {
		return fmt.Errorf("kafka producer needs a restart: %w", firstFailure)
	}
	return nil
}

// quarantineRow keeps a refused event in the quarantine table, then marks
// its row, which holds back its aggregate until `quarantine replay`.
func (w *worker) quarantineRow(ctx context.Context, r *claimed, perr *sink.Error) error {
	f := store.Failure{Topic: perr.Topic, Class: string(perr.Class), Message: sink.Explain(perr)}
	q := store.QuarantinedEvent(&r.ev, f)
	if perr.Record != nil {
		q = store.QuarantinedRecord(perr.Record.Shaped(), f)
	}
	// The attempts the log line below names: one per claim that sent it.
	q.Attempts = r.attempts
	if err := w.quarantine.Put(ctx, q); err != nil {
		return fmt.Errorf("%w: %w; %s", pipeline.ErrQuarantineWrite, err, store.WriteAdvice(err))
	}
	if err := w.marks.markQuarantined(ctx, r.seq, string(perr.Class), perr.Error()); err != nil {
		return err
	}
	w.p.metrics.QuarantinedTotal.Inc()
	w.p.log.Error().Str("event_id", r.eventID).Str("topic", perr.Topic).Str("class", string(perr.Class)).Int("attempts", r.attempts).
		Str("error", perr.Error()).Str("advice", perr.Advice()).
		Msg("event quarantined: later events of its aggregate wait until `outbox-relay quarantine replay` delivers it")
	return nil
}

// buildRecord checks the row's required values as the WAL path does, then
// builds its record, waiting for its topic's lookup.
func buildRecord(ctx context.Context, snk sink.Sink, ev *event.Event) (sink.Record, error) {
	if perr := sink.CheckRow(ev); perr != nil {
		return nil, perr
	}
	return sink.BuildWhenReady(ctx, snk.Build, ev)
}
