package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/store"
)

// Retention is the table sources' rule (store.Retention) and the WAL
// source's margin.
type Retention struct {
	store.Retention
	// Margin is subtracted from the commit time of the relay's confirmed
	// position. A row inserted by a transaction that ran longer than this
	// could otherwise be deleted before it is confirmed.
	Margin time.Duration
}

// DefaultRetention returns cleanup settings with cleanup off.
func DefaultRetention() Retention {
	return Retention{Retention: store.DefaultRetention(), Margin: time.Hour}
}

func (r Retention) validate() error {
	if r.Margin < 0 {
		return fmt.Errorf("--retention-margin %s: must not be negative", r.Margin)
	}
	return r.Retention.Validate()
}

// retainer deletes published outbox rows: one job of the relay, on a
// goroutine of its own, that reads only the position the WAL readers
// publish.
type retainer struct {
	cfg     Config
	log     zerolog.Logger
	metrics *Metrics
	read    *readReport
	// stored is the commit time of the last progress record Kafka holds;
	// zero while none is known.
	stored func() time.Time
}

// run deletes published rows in small batches until ctx ends. A row may
// go only when it is older than the retention and older than the commit time
// of the relay's confirmed position, and of the progress record Kafka
// holds, minus the margin: unconfirmed rows are never deleted, and a lost
// slot's recovery, which reads from the progress record's commit time back
// by the margin, always finds its window whole. (Deleting a row does not unpublish it, the relay reads the
// WAL; the rule keeps the table a complete record of what may still need to
// be reconciled or re-delivered.)
func (r *retainer) run(ctx context.Context) {
	cfg := r.cfg.Retention
	log := r.log.With().Str("component", "retention").Logger()
	tick := time.NewTicker(cfg.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		watermark := r.read.snapshot().confirmedCommit
		if r.cfg.Progress.Topic != "" {
			// Never past what Kafka's progress record holds: a lost
			// slot's recovery reads the table from there.
			watermark = earlier(watermark, r.stored())
		}
		if watermark.IsZero() {
			log.Debug().Msg("no confirmed transaction, or no progress record, yet in this process; deleting nothing")
			r.metrics.RetentionRuns.Inc()
			continue
		}
		cutoff := watermark.Add(-cfg.Margin)
		if byAge := time.Now().Add(-cfg.After); byAge.Before(cutoff) {
			cutoff = byAge
		}
		r.metrics.RetentionWatermark.Set(float64(cutoff.UnixMilli()) / 1000)
		n, err := r.deleteBefore(ctx, cutoff)
		r.metrics.RetentionRuns.Inc()
		if err != nil && ctx.Err() == nil {
			// Streaming goes on: a cleanup that keeps failing shows in
			// outbox_relay_retention_failures_total and its alert.
			r.metrics.RetentionFailures.Inc()
			log.Warn().Err(err).Msg("outbox cleanup failed; retrying next interval (check the role has SELECT and DELETE on the outbox table)")
			continue
		}
		if n > 0 || cfg.DryRun {
			ev := log.Info().Int64("rows", n).Time("cutoff", cutoff)
			if cfg.DryRun {
				ev.Msg("dry run: rows cleanup would delete")
			} else {
				ev.Msg("deleted published outbox rows")
			}
		}
	}
}

// deleteBefore deletes (or, in a dry run, counts) rows created before
// cutoff, a batch per transaction, on a connection of its own for the run.
func (r *retainer) deleteBefore(ctx context.Context, cutoff time.Time) (int64, error) {
	outbox, err := store.ParseTable("--table", r.cfg.Replication.Table)
	if err != nil {
		return 0, err
	}
	conn, err := pg.Dial(ctx, r.cfg.Replication.Config)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	if r.cfg.Retention.DryRun {
		return store.CountCreatedBefore(ctx, conn, outbox, r.cfg.Replication.OutboxLayout(), cutoff)
	}
	return store.DeleteCreatedBefore(ctx, conn, outbox, r.cfg.Replication.OutboxLayout(), cutoff, r.cfg.Retention.Batch, func(n int64) {
		r.metrics.RetentionDeleted.Add(float64(n))
	})
}

// earlier is the earlier of two times, zero when either is zero: a bound
// that is not known yet allows nothing.
func earlier(a, b time.Time) time.Time {
	if a.IsZero() || b.IsZero() {
		return time.Time{}
	}
	if a.Before(b) {
		return a
	}
	return b
}
