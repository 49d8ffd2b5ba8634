package poll

import (
	"context"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/backoff"
	"github.com/outbox-relay/outbox-relay/sink"
)

// worker runs one session's claims and marks; the engine publishes. Its
// claims use one connection and its marks another, so that a mark never
// waits for a claim (see flow).
type worker struct {
	p      *Poller
	claims *queries
	marks  *queries
	// claimsAlive and marksAlive prove the two connections alive: the
	// claimer's goroutine owns the claiming one, the marker's the other.
	claimsAlive, marksAlive *prover
	// rowBytes is the mean size of the rows the last claim took; the
	// next claim asks for about twice as many rows as its byte bound
	// holds of those. The claim reads the size of every row it may take
	// (PostgreSQL converts each value to text for it): with rows of
	// 900 KB, sizing --poll-batch of them for the 18 a batch holds made a
	// backlog drain 2.5 times slower.
	rowBytes int64
	// full says the last claim stopped at a bound (rows or bytes), so more
	// rows are likely pending: a backlog.
	full bool
}

// markTimeout bounds the marks written after the context ended, so a stop
// still records the acks it got.
const markTimeout = 10 * time.Second

// claim leases the next batch.
func (w *worker) claim(ctx context.Context) ([]claimed, error) {
	cfg := w.p.cfg
	budget := pageBytes(cfg.MaxInFlightBytes, leaseBatchesHeld)
	limit := cfg.Batch
	if w.rowBytes > 0 {
		limit = int(min(int64(cfg.Batch), max(1, 2*budget/w.rowBytes)))
	}
	// A claim is bounded by --pg-timeout: behind a dead link it would
	// wait for ever, and it proves the claiming session alive, which the
	// leases it holds live by.
	var rows []claimed
	err := w.claimsAlive.bounded(ctx, w.p.deadAfter(), func(ctx context.Context) (err error) {
		rows, err = w.claims.claimBatch(ctx, limit, budget, cfg.MaxMessageBytes, cfg.Lease)
		return err
	})
	now := time.Now()
	w.p.update(func(s *Status) { s.LastClaimAt = &now })
	if err != nil {
		return nil, err
	}
	w.p.metrics.observeClaim(len(rows))
	w.full = len(rows) == limit || len(rows) > 0 && rows[0].cut
	if len(rows) > 0 {
		var bytes int64
		for i := range rows {
			if rows[i].size <= int64(cfg.MaxMessageBytes) {
				bytes += rows[i].size
			}
		}
		w.rowBytes = max(bytes/int64(len(rows)), 1)
	}
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

// mark records the batch's results. Within the batch, once a row of an
// aggregate failed, its later rows are not marked even when Kafka acked
// them: they go again after it, so the last delivery is in order (the
// first was not: the failed row counts as one order break, however many
// later rows passed it). A quarantined row holds its aggregate back until
// `quarantine replay`. Rows with no result (never sent, or a stop) are
// released to be claimed again.
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
		case res.quarantined:
			// In the quarantine table already, even behind a failure of
			// its aggregate: it waits there for `quarantine replay`.
			blocked[r.aggKey] = true
			if err := w.markQuarantined(ctx, r, res.err); err != nil {
				return err
			}
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
		switch {
		case class == sink.ClassPermanent:
			// --on-permanent-error halt: the engine quarantines the others.
			failures = append(failures, failure{seq: r.seq, delay: cfg.BackoffMin, class: string(class), msg: res.err.Error()})
			if halt == nil {
				halt = fmt.Errorf("%w: %s (--on-permanent-error halt); %s", errHalted, res.err.Error(), res.err.Advice())
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

// markQuarantined marks a row the engine quarantined, which holds back
// its aggregate until `quarantine replay`.
func (w *worker) markQuarantined(ctx context.Context, r *claimed, perr *sink.Error) error {
	if err := w.marks.markQuarantined(ctx, r.seq, string(perr.Class), perr.Error()); err != nil {
		return err
	}
	w.p.metrics.QuarantinedTotal.Inc()
	return nil
}

// quarantineStored is what the log says of each event quarantined.
const quarantineStored = "event quarantined: later events of its aggregate wait until `outbox-relay quarantine replay` delivers it"
