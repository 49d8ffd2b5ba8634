package poll

import (
	"context"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/engine"
	"github.com/outbox-relay/outbox-relay/pipeline"
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
	src := &peekSource{p: p, q: q, after: after, next: time.Now()}
	var quarantine *engine.Quarantiner // under halt, the dry run stops where the poller would
	if p.cfg.OnPermanentError == pipeline.OnPermanentQuarantine {
		quarantine = engine.NewQuarantiner("the dry run's output", p.cfg.DryRun, p.cfg.Batch+2,
			"dry run: the poller would quarantine this event (printed on stdout, written nowhere)")
	}
	loop := engine.New(engine.Config{Log: p.log, Metrics: p.metrics.Metrics, ShutdownTimeout: p.cfg.ShutdownTimeout,
		Quarantine: quarantine}, src, snk)
	return true, loop.Run(ctx)
}

// peekSource reads the pending rows in claim order, then the new rows,
// claiming none, for the engine to print. Its position is a row's index
// in the batch read last.
type peekSource struct {
	p      *Poller
	q      *queries
	rows   []claimed
	events []engine.Event
	// after is the last row printed; next is when to read again.
	after   *int64
	next    time.Time
	pending int // rows of the batch not yet settled
}

// Next reads the next batch once the one before is printed: at once while
// a backlog drains, else at the interval.
func (s *peekSource) Next(ctx context.Context, deadline time.Time) (engine.Read, error) {
	if wait := time.Until(s.next); wait > 0 {
		timer := time.NewTimer(min(wait, time.Until(deadline)))
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-ctx.Done():
		}
		return engine.Read{}, nil
	}
	s.p.hooks.Alive()
	rows, err := s.q.peekBatch(ctx, *s.after, s.p.cfg.Batch, s.p.cfg.MaxMessageBytes)
	if err != nil {
		return engine.Read{}, err
	}
	if len(rows) < s.p.cfg.Batch {
		s.next = time.Now().Add(s.p.cfg.Interval)
	}
	s.rows, s.events = rows, s.events[:0]
	for i := range rows {
		if rows[i].gone {
			continue // deleted from the outbox while pending: nothing to send
		}
		rows[i].ev.Txn = engine.Position(i)
		e := engine.Event{Event: &rows[i].ev}
		if limit := s.p.cfg.MaxMessageBytes; rows[i].size > int64(limit) {
			oversize(&e, rows[i].size, limit, leaseOversizeHeld(s.p.t))
		}
		s.events = append(s.events, e)
	}
	s.pending = len(s.events)
	if len(rows) > 0 && s.pending == 0 {
		*s.after = rows[len(rows)-1].seq
	}
	return engine.Read{Events: s.events}, nil
}

// Sent: a dry run counts nothing.
func (s *peekSource) Sent(engine.Position, int) {}

// Settle moves past a row printed; a row refused under halt stops the dry
// run where the poller would halt.
func (s *peekSource) Settle(pos engine.Position, f engine.Fate) error {
	if f.Err != nil && !f.Quarantined {
		return fmt.Errorf("%w: %s (--on-permanent-error halt); %s", errHalted, f.Err.Error(), f.Err.Advice())
	}
	*s.after = max(*s.after, s.rows[pos].seq)
	if s.pending--; s.pending == 0 {
		*s.after = s.rows[len(s.rows)-1].seq // and the rows gone after it
	}
	return nil
}

func (s *peekSource) Duties(bool) error { return nil }

func (s *peekSource) Wake() time.Time { return time.Now().Add(time.Second) }

// Full: a batch is printed before the next is read, so a restart prints
// no row twice.
func (s *peekSource) Full() bool { return s.pending > 0 }

func (s *peekSource) InTransaction() bool { return false }

func (s *peekSource) Close(bool) {}
