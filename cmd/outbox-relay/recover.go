package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/reconcile"
	"github.com/outbox-relay/outbox-relay/relay"
)

// tableRecoverer recovers a lost slot's gap as `reconcile --republish`
// would: the window's rows that the new slot's snapshot sees, compared
// with Kafka, and those Kafka lacks sent again through run's producer
// settings, oldest first.
type tableRecoverer struct {
	cfg reconcile.Config
	log zerolog.Logger
}

func newTableRecoverer(o *options, log zerolog.Logger) tableRecoverer {
	cfg := reconcileConfig(o)
	cfg.Republish = reconcile.Republish{Enabled: true, Quarantine: o.relay.OnPermanentError == pipeline.OnPermanentQuarantine,
		AckTimeout: 2 * time.Minute}
	return tableRecoverer{cfg: cfg, log: log.With().Str("component", "slot-recovery").Logger()}
}

func (t tableRecoverer) window(w relay.RecoveryWindow) reconcile.Config {
	cfg := t.cfg
	cfg.Since, cfg.Until, cfg.HeldSince, cfg.Snapshot = w.Since, w.Until, w.HeldSince, w.Snapshot
	return cfg
}

func (t tableRecoverer) Check(ctx context.Context, w relay.RecoveryWindow) error {
	return t.refusal(reconcile.CheckTable(ctx, t.window(w)), w)
}

func (t tableRecoverer) Recover(ctx context.Context, w relay.RecoveryWindow) (relay.RecoveryReport, error) {
	cfg := t.window(w)
	cfg.ProgressEvery = 10 * time.Second
	cfg.Progress = func(p reconcile.Progress) {
		t.log.Info().Str("phase", p.Phase).Int64("done", p.Done).Int64("total", p.Total).Str("waiting_on", p.WaitingOn).
			Dur("elapsed", p.Elapsed).Msg("recovering the lost slot")
	}
	rep, err := reconcile.Run(ctx, cfg, t.log)
	if err != nil {
		return relay.RecoveryReport{}, t.refusal(err, w)
	}
	if rep.UncheckedRows > 0 {
		return relay.RecoveryReport{}, t.refusal(fmt.Errorf("%w: %d rows of the window have an event_id that is not a uuid, so nothing tells whether Kafka holds them",
			pg.ErrPrecondition, rep.UncheckedRows), w)
	}
	for _, p := range rep.TruncatedPartitions {
		t.log.Warn().Str("partition", p).Msg("Kafka's retention deleted records of the window from this partition: rows whose records are gone are republished, and consumers may see them twice")
	}
	out := relay.RecoveryReport{RowsChecked: rep.RowsChecked, Found: rep.Found, Missing: int64(len(rep.Missing)),
		Republished: rep.Republished, Quarantined: int64(len(rep.RepublishQuarantined)), Failed: int64(len(rep.RepublishFailed))}
	if len(rep.RepublishFailed) > 0 {
		out.FirstFailure = rep.RepublishFailed[0].EventID.String() + ": " + rep.RepublishFailed[0].Error
	}
	return out, nil
}

// refusal marks what retrying cannot fix as a recovery the table cannot
// serve, with what the operator can do instead.
func (t tableRecoverer) refusal(err error, w relay.RecoveryWindow) error {
	if err == nil || !errors.Is(err, reconcile.ErrWindowDeleted) && !errors.Is(err, pg.ErrPrecondition) {
		return err
	}
	since := w.Since.UTC().Format(time.RFC3339)
	return fmt.Errorf("%w: %w. Republish what the table still holds by hand, `outbox-relay reconcile --since %s --until 0s --republish` with run's connection flags, "+
		"then start once with --on-slot-lost stop --reset-progress (adding --recreate-lost-slot if the slot is invalidated); events whose rows are gone can only come from the services that wrote them",
		relay.ErrSlotUnrecoverable, err, since)
}
