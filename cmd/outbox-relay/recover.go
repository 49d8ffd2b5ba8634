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
	cfg := reconcileConfig(o, log)
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
	// Often, for the relay's status; the log gets every tenth.
	cfg.ProgressEvery = time.Second
	reports := 0
	cfg.Progress = func(p reconcile.Progress) {
		if w.Progress != nil {
			w.Progress(p.Phase, p.Done, p.Total)
		}
		if reports++; reports%10 == 0 {
			t.log.Info().Str("phase", p.Phase).Int64("done", p.Done).Int64("total", p.Total).Str("waiting_on", p.WaitingOn).
				Dur("elapsed", p.Elapsed).Msg("recovering the lost slot")
		}
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
	for _, f := range rep.RepublishFailed {
		if out.FirstFailure == "" || f.Permanent && !out.Permanent {
			out.FirstFailure = f.EventID.String() + ": " + f.Error
		}
		out.Permanent = out.Permanent || f.Permanent
	}
	return out, nil
}

// refusal marks what retrying cannot fix as a recovery the table cannot
// serve, with what the operator can do instead. Each way out makes the new
// slot before it reads the table, so nothing written meanwhile is missed.
func (t tableRecoverer) refusal(err error, w relay.RecoveryWindow) error {
	if err == nil || !errors.Is(err, reconcile.ErrWindowDeleted) && !errors.Is(err, pg.ErrPrecondition) {
		return err
	}
	return fmt.Errorf("%w: %w. Ways out, each of which makes the new slot before it reads the table, so events written meanwhile are not missed: "+
		"fix what is named above and start again; or start once with --existing-rows pending, which compares every row the table still holds with Kafka and republishes those it lacks; "+
		"or with --existing-rows published, which makes the slot and publishes nothing from before it. Events whose rows are gone can only come from the services that wrote them",
		relay.ErrSlotUnrecoverable, err)
}
