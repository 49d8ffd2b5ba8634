package reconcile

import (
	"context"
	"time"

	"github.com/rs/zerolog"
)

// Periodic compares a trailing window every Every, and never republishes.
type Periodic struct {
	Config  Config // Since, Until and Republish are set per check
	Every   time.Duration
	Window  time.Duration
	Settle  time.Duration // the window ends this long before each check
	Metrics *Metrics
	Log     zerolog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Run checks every Every until ctx ends.
func (p *Periodic) Run(ctx context.Context) {
	log := p.Log.With().Str("component", "reconcile").Logger()
	now := p.Now
	if now == nil {
		now = time.Now
	}
	p.Metrics.Interval.Set(p.Every.Seconds())
	tick := time.NewTicker(p.Every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		cfg := p.Config
		cfg.Republish = Republish{}
		cfg.Progress = nil
		cfg.Until = now().Add(-p.Settle)
		cfg.Since = cfg.Until.Add(-p.Window)
		rep, err := Run(ctx, cfg, log)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			p.Metrics.Failures.Inc()
			log.Warn().Err(err).Msg("periodic reconcile failed; retrying next interval")
			continue
		}
		p.Metrics.MissingEvents.Set(float64(len(rep.Missing)))
		p.Metrics.Phantoms.Set(float64(len(rep.Phantoms)))
		p.Metrics.LastComplete.Set(float64(now().UnixMilli()) / 1000)
		ev := log.Info()
		if len(rep.Missing) > 0 {
			ev = log.Error().Strs("first_missing", firstIDs(rep.Missing, 20))
		}
		ev.Int64("rows_checked", rep.RowsChecked).Int("missing", len(rep.Missing)).Int("phantoms", len(rep.Phantoms)).
			Int("quarantined", len(rep.Quarantined)).Int("delivered_more_than_once", len(rep.Duplicated)).
			Time("since", cfg.Since).Time("until", cfg.Until).Dur("took", rep.Elapsed).
			Msg(periodicMessage(rep))
	}
}

func periodicMessage(rep *Report) string {
	if len(rep.Missing) == 0 {
		return "periodic reconcile: nothing missing"
	}
	return "periodic reconcile: outbox rows are missing from Kafka; run `outbox-relay reconcile --since <since> --until <until> --republish`"
}

// firstIDs renders at most n ids.
func firstIDs(ids []EventID, n int) []string {
	out := make([]string, 0, min(n, len(ids)))
	for _, id := range ids[:min(n, len(ids))] {
		out = append(out, id.String())
	}
	return out
}
