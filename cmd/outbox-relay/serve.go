package main

import (
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/store"
)

// service is what run serves, whatever the source: *relay.Relay and
// *poll.Poller.
type service interface {
	Run(ctx context.Context) error
	AdminHandler(gatherer prometheus.Gatherer) http.Handler
}

// serviceSpec is what serve needs of one source's service.
type serviceSpec struct {
	dsn string
	// ready is the state systemd's READY=1 announces.
	ready pipeline.State
	// backoffMax is the longest the service waits between sessions, which
	// the watchdog allows a service that backs off.
	backoffMax time.Duration
	// start adds the source's own fields to the "starting" line.
	start func(*zerolog.Event) *zerolog.Event
	// make makes the service with its series in registry and hooks to
	// call, and returns it with a getter of its state.
	make func(registry *prometheus.Registry, hooks pipeline.Hooks) (service, func() pipeline.Status, error)
}

// serve is `run` for every source once its settings are checked: systemd's
// notifications (READY, the watchdog, STATUS from the service's state,
// STOPPING as soon as the shutdown begins), the periodic reconcile, the
// admin endpoint, the start line, and the exit code.
func serve(ctx context.Context, o *options, log zerolog.Logger, stderr io.Writer, spec serviceSpec) int {
	registry := prometheus.NewRegistry()
	notifier := newSystemdNotifier(log)
	svc, state, err := spec.make(registry, pipeline.Hooks{Running: func() { notifier.readyAs(spec.ready) }, Alive: notifier.alive})
	if err != nil {
		return usageError(stderr, "run", err, spec.dsn)
	}
	notifier.watch(ctx, state, spec.dsn, spec.backoffMax)
	// The comparison reads the outbox table and Kafka, never a source's
	// state, so it checks every source's work alike.
	periodicCtx, stopPeriodic := context.WithCancel(ctx)
	periodicDone := startPeriodicReconcile(periodicCtx, o, registry, log)
	defer func() {
		stopPeriodic()
		periodicDone()
	}()
	stopAdmin, err := serveAdmin(o.adminAddr, svc.AdminHandler(registry), log)
	if err != nil {
		notifier.stopping()
		return usageError(stderr, "run", err, "")
	}
	defer stopAdmin()
	start := log.Info().Str("version", versionString()).Str("source", o.source).Str("postgres", pg.Describe(spec.dsn)).
		Strs("kafka_brokers", o.kafka.Brokers)
	spec.start(start).Str("topic", o.kafka.TopicTemplate).Msg("starting")
	if err := checkPartitionRegistry(ctx, o); err != nil {
		notifier.stopping()
		return exitCode(err, spec.dsn, log)
	}
	err = svc.Run(ctx)
	notifier.stopping()
	return exitCode(err, spec.dsn, log)
}

// checkPartitionRegistry stops a relay whose partition count registry is
// missing, a deploy that skipped migrate, at its start rather than at its
// first record, which on an idle outbox may come hours later. It speaks
// only for a relay upgraded over what an older migrate made (the outbox
// table, or for the messages source the slot): on a database migrate
// never ran on, the relay's own checks name what is missing first.
// PostgreSQL out of reach is left to the run, which waits for it; the
// registry is read again where keys are first mapped, with the same error.
func checkPartitionRegistry(ctx context.Context, o *options) error {
	cfg := o.relay.Replication.Config
	registry, err := store.NewPartitions(cfg)
	if err != nil {
		return nil // a --table that does not parse is refused with the flag named
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pg.Dial(ctx, cfg)
	if err != nil {
		return nil
	}
	defer conn.Close(context.Background())
	var upgraded bool
	if o.relay.Replication.ReadsTable() {
		outbox, _ := store.ParseTable("--table", cfg.Table)
		err = conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", outbox.Quoted()).Scan(&upgraded)
	} else {
		err = conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)", o.relay.Replication.Slot).Scan(&upgraded)
	}
	if err != nil || !upgraded {
		return nil
	}
	if err := registry.Check(ctx, conn); errors.Is(err, pg.ErrPrecondition) {
		return err
	}
	return nil
}
