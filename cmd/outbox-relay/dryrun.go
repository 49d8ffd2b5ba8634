package main

import (
	"context"
	"io"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/dryrun"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/poll"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/store"
)

// runDry is `run --dry-run`: the configuration is checked as run checks
// it, and the source's records go to stdout instead of Kafka. Kafka is
// only asked, read-only, how many partitions each topic has, and the
// partition count registry what count each topic's keys are mapped by.
func runDry(ctx context.Context, o *options, source sourceSpec, log zerolog.Logger, stdout, stderr io.Writer) int {
	namer, err := publisher.NewTopicNamer(o.kafka.TopicTemplate)
	if err != nil {
		return usageError(stderr, "run", err, "")
	}
	partitions := publisher.NewPartitioner(o.kafka)
	defer partitions.Close()
	// Keys as the relay maps them: by the count recorded for the topic,
	// read only (a dry run records nothing).
	if registry, err := store.NewPartitions(o.relay.Replication.Config); err == nil {
		partitions.UseRecorded(registry)
	}
	printer := dryrun.NewPrinter(stdout, namer.Topic, partitions.Partition)
	return source.dryRun(ctx, o, printer, log.With().Bool("dry_run", true).Logger(), stderr)
}

// dryRunRelay is the dry run of the sources that stream a slot.
func dryRunRelay(ctx context.Context, o *options, printer *dryrun.Printer, log zerolog.Logger, stderr io.Writer) int {
	cfg := o.relayConfig(log)
	if err := validateRun(o, cfg); err != nil {
		return usageError(stderr, "run", err, cfg.Replication.DSN)
	}
	// Nothing is written to Kafka, so the delivery mode changes nothing
	// printed; the records are those of either.
	cfg.Delivery = relay.DeliveryAtLeastOnce
	cfg.DryRun = printer
	log.Info().Str("source", o.source).Str("postgres", pg.Describe(cfg.Replication.DSN)).Str("topic", o.kafka.TopicTemplate).
		Stringer("record_format", cfg.Replication.OutboxLayout().RecordFormat()).Msg("starting a dry run")
	return exitCode(relay.New(cfg, log, nil, relay.Hooks{}).Run(ctx), cfg.Replication.DSN, log)
}

// dryRunPoll is poll mode's dry run.
func dryRunPoll(ctx context.Context, o *options, printer *dryrun.Printer, log zerolog.Logger, stderr io.Writer) int {
	cfg := o.pollConfig(log)
	if err := cfg.Validate(); err != nil {
		return usageError(stderr, "run", err, cfg.Postgres.DSN)
	}
	if err := o.requireBrokers(); err != nil {
		return usageError(stderr, "run", err, cfg.Postgres.DSN)
	}
	cfg.DryRun = printer
	p, err := poll.New(cfg, log, poll.NewMetrics(nil), poll.Hooks{})
	if err != nil {
		return usageError(stderr, "run", err, cfg.Postgres.DSN)
	}
	log.Info().Str("source", o.source).Str("postgres", pg.Describe(cfg.Postgres.DSN)).Str("table", cfg.Postgres.Table).
		Str("topic", o.kafka.TopicTemplate).Msg("starting a dry run")
	return exitCode(p.Run(ctx), cfg.Postgres.DSN, log)
}
