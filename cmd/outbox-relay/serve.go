package main

import (
	"context"
	"io"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
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
	err = svc.Run(ctx)
	notifier.stopping()
	return exitCode(err, spec.dsn, log)
}
