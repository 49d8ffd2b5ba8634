package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/poll"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
)

// pollStrategyFlag is --poll-strategy, which run, migrate and status take.
func pollStrategyFlag(fs *flag.FlagSet, o *options) {
	fs.StringVar(&o.poll.Strategy, "poll-strategy", o.poll.Strategy, "poll mode: lease (claim rows from a state table beside the outbox; several pollers share a table) or snapshot (read the rows of the transactions that became visible since the last snapshot published, as PgQ does: no write per event, one poller at a time with standbys); see docs/poll-mode.md")
}

func pollFlags(fs *flag.FlagSet, o *options) {
	c := &o.poll
	pollStrategyFlag(fs, o)
	fs.IntVar(&c.Batch, "poll-batch", c.Batch, "poll mode: rows one claim (lease) or one page of a snapshot's rows (snapshot) takes")
	fs.DurationVar(&c.Lease, "poll-lease", c.Lease, "poll mode, lease strategy: how long a claim keeps other pollers off its rows; must outlast a publish: at least 2 x (2 x --kafka-timeout + --kafka-retry-backoff-max)")
	fs.DurationVar(&c.Interval, "poll-interval", c.Interval, "poll mode: how often an idle poller looks for rows when no notification woke it")
	fs.DurationVar(&c.Tick, "poll-tick", c.Tick, "poll mode: least time between two claims while rows trickle in, so the commits within it go out together: less CPU on PostgreSQL per event for up to this much latency (0: claim at every wake-up)")
	fs.BoolVar(&c.Notify, "poll-notify", c.Notify, "poll mode: wake on the trigger's NOTIFY at commit (turn off behind a transaction-mode pooler, which does not carry LISTEN)")
	fs.BoolVar(&c.SessionCheck, "poll-session-check", c.SessionCheck, "poll mode, lease strategy: a lease is free as soon as the PostgreSQL session that took it is gone (its poller died), and a WAL relay sees that a poller runs; turn off behind a transaction-mode pooler, whose server sessions outlive the poller (leases then last --poll-lease)")
	// The default is this process's host:pid, known only at run time: a
	// flag.Func shows no default of its own, so -h prints the usage's
	// "(default host:pid)" once instead of also this process's value.
	fs.Func("poll-worker-id", "poll mode, lease strategy: this poller's `name` in its leases and on /poll, unique among the table's pollers; with --poll-session-check=false, a stable one (e.g. the unit's instance) lets a restarted poller take back its own leases at once (default host:pid)",
		func(v string) error { c.WorkerID = v; return nil })
	fs.IntVar(&c.MaxAttempts, "max-attempts", c.MaxAttempts, "poll mode: attempts of an event that keeps failing with retriable errors before it goes to the quarantine table")
	fs.DurationVar(&c.BackoffMin, "poll-backoff-min", c.BackoffMin, "poll mode, lease strategy: first wait before an event's next attempt; doubled per attempt, with jitter")
	fs.DurationVar(&c.BackoffMax, "poll-backoff-max", c.BackoffMax, "poll mode, lease strategy: longest wait between an event's attempts")
}

func pollMigrateFlags(fs *flag.FlagSet, o *options) {
	pollStrategyFlag(fs, o)
	fs.BoolVar(&o.poll.Notify, "poll-notify", o.poll.Notify, "poll mode: a NOTIFY at every commit that inserts into the outbox wakes the pollers; false leaves it out (the lease strategy's trigger records rows without it; the snapshot strategy's trigger, which only notifies, is dropped) for writers that use PREPARE TRANSACTION, which PostgreSQL refuses after a NOTIFY; run the pollers with --poll-notify=false too, and they look every --poll-interval")
	fs.StringVar(&o.pollExisting, "poll-existing", "pending", "with --source poll, the rows already in the outbox when poll mode first tracks them: pending (published again: duplicates, never loss) or published (another relay published them all, and is stopped)")
}

// pollConfig is poll mode's configuration from the flags shared with the
// WAL path and its own.
func (o *options) pollConfig(log zerolog.Logger) poll.Config {
	c := o.poll
	c.Postgres = o.relay.Replication.Config
	c.Slot = o.relay.Replication.Slot
	c.Sinks = publisher.NewKafka(o.kafkaConfig(log), log)
	c.QuarantineTable = o.relay.QuarantineTable
	c.OnPermanentError = o.relay.OnPermanentError
	c.ShutdownTimeout = o.relay.ShutdownTimeout
	c.MaxInFlightBytes = o.relay.MaxInFlightBytes
	c.MaxMessageBytes = o.relay.Replication.MaxMessageBytes
	r := o.relay.Retention
	c.Retention = r.Retention
	return c
}

// runPoll is run --source poll.
func runPoll(ctx context.Context, o *options, log zerolog.Logger, stderr io.Writer) int {
	if err := o.reconcile.validatePeriodic(); err != nil {
		return usageError(stderr, "run", err, "")
	}
	if o.relay.Retention.Margin != relay.DefaultRetention().Margin {
		// Only the WAL source needs it: it infers what was published from
		// the confirmed position, where poll mode marks each row.
		return usageError(stderr, "run", fmt.Errorf("--retention-margin %s with --source poll: poll mode deletes only rows marked published, so no margin applies; drop it", o.relay.Retention.Margin), "")
	}
	cfg := o.pollConfig(log)
	if err := cfg.Validate(); err != nil {
		return usageError(stderr, "run", err, cfg.Postgres.DSN)
	}
	if err := o.requireBrokers(); err != nil {
		return usageError(stderr, "run", err, cfg.Postgres.DSN)
	}
	return serve(ctx, o, log, stderr, serviceSpec{
		dsn: cfg.Postgres.DSN, ready: pipeline.StatePolling, backoffMax: cfg.RestartBackoffMax,
		start: func(e *zerolog.Event) *zerolog.Event {
			return e.Str("table", cfg.Postgres.Table).Stringer("record_format", cfg.Postgres.OutboxLayout().RecordFormat())
		},
		make: func(registry *prometheus.Registry, hooks pipeline.Hooks) (service, func() pipeline.Status, error) {
			m := poll.NewMetrics(registry)
			o.observeKafka(m.Metrics)
			p, err := poll.New(cfg, log, m, hooks)
			if err != nil {
				return nil, nil, err
			}
			return p, func() pipeline.Status { return p.Status().Status }, nil
		},
	})
}

// pollStatus is status --source poll.
func pollStatus(ctx context.Context, o *options, stdout, stderr io.Writer) int {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	cfg := o.pollConfig(zerolog.Nop())
	if cfg.Strategy == poll.StrategySnapshot {
		return snapshotStatus(ctx, o, cfg, stdout, stderr)
	}
	stats, err := poll.ReadStatus(ctx, cfg)
	if err != nil {
		return failure(stderr, "status", err, cfg.Postgres.DSN)
	}
	report := struct {
		Source string `json:"source"`
		poll.Stats
		OldestPendingAgeSeconds *float64 `json:"oldest_pending_age_seconds,omitempty"`
	}{Source: o.source, Stats: stats}
	if stats.OldestPending != nil {
		age := time.Since(*stats.OldestPending).Seconds()
		report.OldestPendingAgeSeconds = &age
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	enc.Encode(report)
	return exitOK
}

// snapshotStatus is status --source poll --poll-strategy snapshot.
func snapshotStatus(ctx context.Context, o *options, cfg poll.Config, stdout, stderr io.Writer) int {
	st, err := poll.ReadSnapshotStatus(ctx, cfg)
	if err != nil {
		return failure(stderr, "status", err, cfg.Postgres.DSN)
	}
	report := struct {
		Source   string `json:"source"`
		Strategy string `json:"strategy"`
		poll.SnapshotStatus
	}{Source: o.source, Strategy: cfg.Strategy, SnapshotStatus: st}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	enc.Encode(report)
	return exitOK
}
