package poll

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// dryRunSession is a session of a dry run (see Config.DryRun). after is
// the last row printed, kept across sessions so a restart prints no row
// twice.
func (p *Poller) dryRunSession(ctx context.Context, after *int64) (polled bool, err error) {
	conn, err := p.dial(ctx)
	if err != nil {
		return false, err
	}
	defer conn.Close(context.Background())
	q, err := newQueries(ctx, conn, p.t, p.cfg.Postgres.OutboxLayout(), p.cfg.WorkerID, false)
	if err != nil {
		return false, err
	}
	snk, err := p.cfg.DryRun.NewSink()
	if err != nil {
		return false, err
	}
	defer snk.Close(p.cfg.ShutdownTimeout)
	p.setState(pipeline.StatePolling, nil)
	p.hooks.Running()
	p.log.Info().Str("table", p.t.outbox.String()).Str("state_table", p.t.state.String()).Int64("after_seq", *after).
		Msg("dry run: printing the records of the pending rows in claim order, then of new rows; nothing is claimed, published or marked")
	interval := time.NewTicker(p.cfg.Interval)
	defer interval.Stop()
	for {
		p.hooks.Alive()
		rows, err := q.peekBatch(ctx, *after, p.cfg.Batch)
		if err != nil {
			return true, err
		}
		for i := range rows {
			if err := p.dryRunRow(ctx, snk, &rows[i]); err != nil {
				return true, err
			}
			*after = rows[i].seq
		}
		if len(rows) == p.cfg.Batch {
			continue
		}
		select {
		case <-ctx.Done():
			return true, nil
		case <-interval.C:
		}
	}
}

// dryRunRow prints one row's record, or hands it to the dry run as the
// poller would quarantine it; under --on-permanent-error halt the dry run
// stops on it, as the poller would.
func (p *Poller) dryRunRow(ctx context.Context, snk sink.Sink, r *claimed) error {
	if r.gone {
		return nil // deleted from the outbox while pending: nothing to send
	}
	rec, err := buildRecord(ctx, snk, &r.ev)
	var perr *sink.Error
	if errors.As(err, &perr) && perr.Class == sink.ClassPermanent {
		if p.cfg.OnPermanentError == pipeline.OnPermanentHalt {
			return fmt.Errorf("%w: %s (--on-permanent-error halt); %s", errHalted, perr.Error(), perr.Advice())
		}
		f := store.Failure{Topic: perr.Topic, Class: string(perr.Class), Message: sink.Explain(perr)}
		return p.cfg.DryRun.Put(ctx, store.QuarantinedEvent(&r.ev, f))
	}
	if err != nil {
		return err
	}
	select {
	case snk.Input() <- sink.Item{Record: rec}:
	case <-ctx.Done():
		return nil
	}
	select {
	case o := <-snk.Outcomes():
		if o.Err != nil {
			return o.Err
		}
		return nil
	case <-ctx.Done():
		return nil
	}
}
