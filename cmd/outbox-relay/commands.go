package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/poll"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// version is stamped at build time with -ldflags "-X main.version=...";
// versionString falls back to what the Go toolchain recorded.
var version string

const usage = `usage: outbox-relay <command> [flags]

commands:
  run       stream committed outbox rows to Kafka
  migrate   create the outbox table, its publication and the replication slot
  status    print the slot's state from PostgreSQL (needs no running relay)
  quarantine list | replay <event_id>... | replay --all
            show or re-publish events Kafka refused
  reconcile --since DURATION|RFC3339 [--until ...] [--republish] [--json]
            find outbox rows missing from Kafka, and republish them
  partitions show | adopt   the partition counts event topics' keys are mapped by
  version   print the version

Run 'outbox-relay <command> -h' for a command's flags. Every flag can also be
set as OUTBOX_RELAY_<FLAG> (upper case, '-' as '_') or in a --config YAML file.

Exit codes, the same for every command: 0 success, 1 failure (PostgreSQL or
Kafka unreachable or refusing, a precondition not met), 2 bad flags or
configuration; reconcile adds 3: events missing from Kafka.
`

// Exit codes, one contract for every command.
const (
	exitOK      = 0
	exitFailure = 1 // the command ran and failed; fix the environment, not the flags
	exitUsage   = 2 // bad flags or configuration, found before anything was touched
	exitMissing = 3 // reconcile: events missing from Kafka and not republished
)

// versionString is the stamped version, else what the Go toolchain
// recorded in the binary.
func versionString() string {
	info, _ := debug.ReadBuildInfo()
	return versionFrom(version, info)
}

// versionFrom picks the stamped version, else the module version (go
// install module@version), else the VCS revision of a build from a
// checkout, else "dev".
func versionFrom(stamped string, info *debug.BuildInfo) string {
	if stamped != "" {
		return stamped
	}
	if info == nil {
		return "dev"
	}
	if v := info.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var revision, modified string
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			revision = s.Value
		case "vcs.modified":
			modified = s.Value
		}
	}
	if revision == "" {
		return "dev"
	}
	if modified == "true" {
		revision += "-dirty"
	}
	return "dev-" + revision
}

// run dispatches a command and maps its outcome to an exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	commands := map[string]func(context.Context, []string, io.Writer, io.Writer) int{
		"run": runCommand, "migrate": migrateCommand, "status": statusCommand, "quarantine": quarantineCommand,
		"reconcile": reconcileCommand, "partitions": partitionsCommand,
	}
	switch args[0] {
	case "version", "--version", "-version":
		fmt.Fprintf(stdout, "outbox-relay %s\n", versionString())
		return exitOK
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return exitOK
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "outbox-relay: unknown command %q\n\n%s", args[0], usage)
		return exitUsage
	}
	if args[0] == "run" {
		// run stops on its own: it drains within --shutdown-timeout.
		return cmd(ctx, args[1:], stdout, stderr)
	}
	return untilInterrupted(ctx, args[0], func() int { return cmd(ctx, args[1:], stdout, stderr) }, stderr)
}

// interruptGrace is how long a one-shot command may take to stop after
// SIGINT or SIGTERM before it is abandoned.
const interruptGrace = 3 * time.Second

// untilInterrupted runs a one-shot command, and once ctx ends (SIGINT,
// SIGTERM) gives it interruptGrace to return. Some of the Kafka client's
// waits take no context, so a command blocked on a silent broker would
// otherwise ignore the signal until its timeout.
func untilInterrupted(ctx context.Context, command string, cmd func() int, stderr io.Writer) int {
	done := make(chan int, 1)
	go func() { done <- cmd() }()
	select {
	case code := <-done:
		return code
	case <-ctx.Done():
	}
	select {
	case code := <-done:
		return code
	case <-time.After(interruptGrace):
		fmt.Fprintf(stderr, "outbox-relay %s: interrupted while waiting on Kafka or PostgreSQL; stopped without finishing. Nothing is lost: run it again\n", command)
		return exitFailure
	}
}

// setup parses a command's flags and returns its positional arguments,
// refusing more than maxArgs of them; on failure it prints one line and
// returns nil options and the exit code to use.
func setup(command string, args []string, maxArgs int, stderr io.Writer) (*options, []string, int) {
	o := &options{}
	fs := newFlagSet(command, o, stderr)
	positional, err := parse(fs, o, args)
	if errors.Is(err, flag.ErrHelp) {
		return nil, nil, exitOK
	}
	if err == nil && len(positional) > maxArgs {
		err = fmt.Errorf("unexpected argument %q (see outbox-relay %s -h)", positional[maxArgs], command)
	}
	if err != nil {
		return nil, nil, usageError(stderr, command, err, o.relay.Replication.DSN)
	}
	return o, positional, -1
}

// logLevels are the levels --log-level takes. zerolog knows more, but
// trace adds nothing here, and fatal, panic and disabled would hide the
// error line a failing command ends with.
var logLevels = map[string]zerolog.Level{
	"debug": zerolog.DebugLevel, "info": zerolog.InfoLevel, "warn": zerolog.WarnLevel, "error": zerolog.ErrorLevel,
}

func newLogger(level string, stderr io.Writer) (zerolog.Logger, error) {
	lvl, ok := logLevels[level]
	if !ok {
		return zerolog.Nop(), fmt.Errorf("--log-level %q: use debug, info, warn or error", level)
	}
	var out io.Writer = stderr
	if f, ok := stderr.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
		out = zerolog.ConsoleWriter{Out: stderr, TimeFormat: time.RFC3339}
	}
	return zerolog.New(out).Level(lvl).With().Timestamp().Logger(), nil
}

// operatorMessage is an error as the operator reads it where it leaves the
// program: with what to do about a Kafka failure (said once, however often
// the error was wrapped), and no password of dsn.
func operatorMessage(err error, dsn string) string {
	return pg.RedactError(sink.Explain(err), dsn)
}

// usageError reports bad flags or configuration.
func usageError(stderr io.Writer, command string, err error, dsn string) int {
	fmt.Fprintf(stderr, "outbox-relay %s: %s\n", command, operatorMessage(err, dsn))
	return exitUsage
}

// failure reports a command that ran and failed.
func failure(stderr io.Writer, command string, err error, dsn string) int {
	fmt.Fprintf(stderr, "outbox-relay %s: %s\n", command, operatorMessage(err, dsn))
	return exitFailure
}

// validateRun checks everything run needs before it touches PostgreSQL or
// Kafka, so a setting that can never work exits 2 at once instead of
// failing every session.
func validateRun(o *options, c relay.Config) error {
	if err := o.requireBrokers(); err != nil {
		return err
	}
	return c.Validate()
}

func runCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, _, code := setup("run", args, 0, stderr)
	if o == nil {
		return code
	}
	log, err := newLogger(o.logLevel, stderr)
	if err != nil {
		return usageError(stderr, "run", err, "")
	}
	source, err := validateSource(o)
	if err != nil {
		return usageError(stderr, "run", err, "")
	}
	stopTracing, err := startTracing(ctx, o, log)
	if err != nil {
		return usageError(stderr, "run", err, "")
	}
	defer stopTracing()
	if o.dryRun {
		return runDry(ctx, o, source, log, stdout, stderr)
	}
	return source.run(ctx, o, log, stderr)
}

// runRelay is run for the sources the relay streams from a replication
// slot.
func runRelay(ctx context.Context, o *options, log zerolog.Logger, stderr io.Writer) int {
	cfg := o.relayConfig(log)
	if err := validateRun(o, cfg); err != nil {
		return usageError(stderr, "run", err, cfg.Replication.DSN)
	}
	if err := o.reconcile.validatePeriodic(); err != nil {
		return usageError(stderr, "run", err, "")
	}

	cfg.Progress.RelayVersion = version
	gcPercent, memoryLimit := tuneGC(cfg, os.Getenv)
	return serve(ctx, o, log, stderr, serviceSpec{
		dsn: cfg.Replication.DSN, ready: pipeline.StateStreaming, backoffMax: cfg.BackoffMax,
		start: func(e *zerolog.Event) *zerolog.Event {
			if !cfg.Replication.ReadsTable() {
				e = e.Str("message_prefix", o.messagePrefix)
			} else {
				e = e.Str("table", cfg.Replication.Table)
			}
			return e.Stringer("record_format", cfg.Replication.OutboxLayout().RecordFormat()).Int("gogc", gcPercent).Int64("gomemlimit", memoryLimit)
		},
		make: func(registry *prometheus.Registry, hooks pipeline.Hooks) (service, func() pipeline.Status, error) {
			m := relay.NewMetrics(registry)
			o.observeKafka(m.Metrics)
			r := relay.New(cfg, log, m, hooks)
			return r, func() pipeline.Status { return r.Status().Status }, nil
		},
	})
}

// exitCode logs the error a run ended with, if any, and says how the
// process exits.
func exitCode(err error, dsn string, log zerolog.Logger) int {
	if err == nil {
		return exitOK
	}
	log.Error().Msg(operatorMessage(err, dsn))
	if errors.Is(err, layout.ErrColumnMapping) {
		// The flags name columns the table does not have: bad
		// configuration, found before anything was made or claimed.
		return exitUsage
	}
	return exitFailure
}

func migrateCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, _, code := setup("migrate", args, 0, stderr)
	if o == nil {
		return code
	}
	// Names are checked on every path, --print-sql included: they end up
	// in SQL text.
	if err := validateNames(o); err != nil {
		return usageError(stderr, "migrate", err, o.relay.Replication.DSN)
	}
	if o.slotOnly && o.skipSlot {
		return usageError(stderr, "migrate", errors.New("--slot-only and --skip-slot contradict each other: give one of them"), "")
	}
	switch o.relay.ExistingRows {
	case relay.ExistingRowsRefuse, relay.ExistingRowsPublished:
	case relay.ExistingRowsPending:
		return usageError(stderr, "migrate", errors.New("--existing-rows pending: migrate does not publish, so it cannot republish what Kafka lacks; start `outbox-relay run --existing-rows pending` instead, which makes the slot"), "")
	default:
		return usageError(stderr, "migrate", fmt.Errorf("--existing-rows %q: use %s or %s", o.relay.ExistingRows, relay.ExistingRowsRefuse, relay.ExistingRowsPublished), "")
	}
	source, err := validateSource(o)
	if err != nil {
		return usageError(stderr, "migrate", err, "")
	}
	if s := o.poll.Strategy; s != poll.StrategyLease && s != poll.StrategySnapshot {
		return usageError(stderr, "migrate", fmt.Errorf("--poll-strategy %q: use %s or %s", s, poll.StrategyLease, poll.StrategySnapshot), "")
	}
	if o.pollExisting != "pending" && o.pollExisting != "published" {
		return usageError(stderr, "migrate", fmt.Errorf("--poll-existing %q: use pending or published", o.pollExisting), "")
	}
	if o.relay.ExistingRows == relay.ExistingRowsPublished {
		switch {
		case o.skipSlot:
			return usageError(stderr, "migrate", errors.New("--existing-rows published with --skip-slot: it says what the slot made now leaves behind, and --skip-slot makes none; drop one of them"), "")
		case !o.relay.Replication.ReadsTable() || source.noSlot != "":
			return usageError(stderr, "migrate", fmt.Errorf("--existing-rows published with --source %s: this source makes no slot over an outbox table's rows; drop the flag", source.name), "")
		}
	}
	if source.noSlot != "" {
		if o.slotOnly {
			return usageError(stderr, "migrate", fmt.Errorf("--slot-only with --source %s: %s", source.name, source.noSlot), "")
		}
		o.skipSlot = true
	}
	schema, table, _ := pg.SplitTable(o.relay.Replication.Table)
	names := migrations.Names{Schema: schema, Table: table, Publication: o.relay.Replication.Publication,
		Quarantine: o.relay.QuarantineTable, ExternalTable: !o.relay.Replication.OutboxLayout().CreatesTable(),
		ExistingPublished: o.pollExisting == "published", Layout: o.relay.Replication.OutboxLayout()}
	source.schema(o, &names)
	if source.noTable != "" && names.ExternalTable {
		return usageError(stderr, "migrate", fmt.Errorf("--outbox-layout debezium with --source %s: the %s source has no outbox table; drop --outbox-layout", source.name, source.name), "")
	}
	if o.printSQL {
		// The same parts a migrate with these flags would create.
		var script string
		if !o.slotOnly {
			tables, err := migrations.SQL(names)
			if err != nil {
				return usageError(stderr, "migrate", err, "")
			}
			script = tables
		}
		if !o.skipSlot {
			slotSQL, err := migrations.SlotSQL(o.relay.Replication.Slot)
			if err != nil {
				return usageError(stderr, "migrate", err, "")
			}
			script += slotSQL
		}
		fmt.Fprint(stdout, script)
		return exitOK
	}
	if err := o.relay.Replication.Validate(); err != nil {
		return usageError(stderr, "migrate", err, o.relay.Replication.DSN)
	}
	log, err := newLogger(o.logLevel, stderr)
	if err != nil {
		return usageError(stderr, "migrate", err, "")
	}
	dsn := o.relay.Replication.DSN
	admin, err := replication.Connect(ctx, o.relay.Replication)
	if err != nil {
		return failure(stderr, "migrate", err, dsn)
	}
	defer admin.Close(context.Background())
	if !o.slotOnly {
		if names.ExternalTable {
			// Another tool's table is checked before anything is made for
			// it: columns that do not match the layout are a flag problem.
			if err := admin.CheckColumns(ctx); err != nil {
				if errors.Is(err, layout.ErrColumnMapping) {
					return usageError(stderr, "migrate", err, dsn)
				}
				return failure(stderr, "migrate", err, dsn)
			}
		}
		conn, err := pg.Dial(ctx, o.relay.Replication.Config)
		if err != nil {
			return failure(stderr, "migrate", err, dsn)
		}
		defer conn.Close(context.Background())
		created, err := migrations.Apply(ctx, conn, names)
		if err != nil {
			return failure(stderr, "migrate", err, dsn)
		}
		if source.noTable == "" {
			if err := admin.CheckColumns(ctx); err != nil {
				return failure(stderr, "migrate", err, dsn)
			}
		}
		ev := log.Info().Str("publication", o.relay.Replication.Publication)
		if source.noTable != "" {
			ev = ev.Str("source", source.name)
		} else {
			ev = ev.Str("table", o.relay.Replication.Table)
		}
		if len(created) > 0 {
			ev.Strs("created", created).Msg("created the schema objects that were missing")
		} else {
			ev.Msg("schema is up to date")
		}
	}
	if o.skipSlot {
		return exitOK
	}
	if err := admin.Check(ctx); err != nil {
		return failure(stderr, "migrate", fmt.Errorf("before creating the slot: %w", err), dsn)
	}
	limits, err := admin.SlotLimits(ctx)
	if err != nil {
		return failure(stderr, "migrate", err, dsn)
	}
	for _, w := range limits.Warnings() {
		log.Warn().Str("slot", o.relay.Replication.Slot).Msg(w)
	}
	return migrateSlot(ctx, o, admin, log, stderr)
}

// migrateSlot makes the slot, when it is missing and nothing says it
// was lost or that the table holds rows no slot covered; records a slot an
// earlier version made; and otherwise leaves it to the relay, which can
// republish, unless --existing-rows published says to make it anyway.
func migrateSlot(ctx context.Context, o *options, admin *replication.Admin, log zerolog.Logger, stderr io.Writer) int {
	dsn := o.relay.Replication.DSN
	slotLog := log.With().Str("slot", o.relay.Replication.Slot).Logger()
	info, exists, err := admin.Slot(ctx)
	if err != nil {
		return failure(stderr, "migrate", err, dsn)
	}
	hist, err := admin.History(ctx)
	if err != nil {
		return failure(stderr, "migrate", err, dsn)
	}
	tableSource := o.relay.Replication.ReadsTable()
	if exists {
		if err := admin.CheckSlot(ctx, info); err != nil {
			return failure(stderr, "migrate", err, dsn)
		}
		if tableSource && hist.Record == nil && !hist.NoRegistry {
			at, _ := info.Confirmed()
			now, err := admin.Clock(ctx)
			if err == nil {
				err = admin.RecordSlot(ctx, replication.SlotRecord{LSN: at, CreatedAt: now, CreatedBy: "adopted", ExistingRows: replication.ExistingAdopted})
			}
			if err != nil {
				slotLog.Warn().Err(err).Msg("cannot record the replication slot in PostgreSQL")
			}
		}
		slotLog.Info().Msg("replication slot exists")
		return exitOK
	}
	existing := ""
	if tableSource {
		why, found, err := admin.WhyNotMake(ctx, hist)
		if err != nil {
			return failure(stderr, "migrate", err, dsn)
		}
		existing = found
		if why != "" {
			if o.relay.ExistingRows != relay.ExistingRowsPublished {
				return failure(stderr, "migrate", fmt.Errorf("the schema is up to date, and the slot was not made: %w", replication.LostHistoryError(o.relay.Replication, why, true)), dsn)
			}
			existing = replication.ExistingPublished
			slotLog.Error().Str("why", why).Msg("making the replication slot over rows no record says were published, as --existing-rows published says: events committed before it that Kafka lacks are NOT published")
		}
	}
	before, err := admin.Clock(ctx)
	if err != nil {
		return failure(stderr, "migrate", err, dsn)
	}
	at, err := admin.CreateSlot(ctx)
	if err != nil {
		return failure(stderr, "migrate", err, dsn)
	}
	if tableSource {
		if err := admin.RecordSlot(ctx, replication.SlotRecord{LSN: at, CreatedAt: before, CreatedBy: "migrate", ExistingRows: existing}); err != nil {
			slotLog.Warn().Err(err).Msg("cannot record the replication slot in PostgreSQL: should it be lost, the relay cannot tell that from a first start and will stop and ask")
		}
	}
	relay.LogNewSlot(ctx, slotLog, admin, o.relay.Replication, at)
	return exitOK
}

// validateNames checks the names migrate writes into SQL; --print-sql
// needs no DSN.
func validateNames(o *options) error {
	if err := o.relay.Replication.ValidateNames(); err != nil {
		return err
	}
	return validateQuarantineTable(o)
}

// validateQuarantineTable checks --quarantine-table; empty is the default.
func validateQuarantineTable(o *options) error {
	_, err := store.QuarantineTable(o.relay.Replication.Table, o.relay.QuarantineTable)
	return err
}

func statusCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, _, code := setup("status", args, 0, stderr)
	if o == nil {
		return code
	}
	if err := o.relay.Replication.Validate(); err != nil {
		return usageError(stderr, "status", err, o.relay.Replication.DSN)
	}
	source, err := validateSource(o)
	if err != nil {
		return usageError(stderr, "status", err, "")
	}
	return source.status(ctx, o, stdout, stderr)
}

// slotStatus is status for the sources the relay streams from a
// replication slot: the slot's state, and with --kafka-brokers the
// progress kept in Kafka.
func slotStatus(ctx context.Context, o *options, stdout, stderr io.Writer) int {
	if err := o.relay.ValidateDelivery(); err != nil {
		return usageError(stderr, "status", err, o.relay.Replication.DSN)
	}
	if len(o.kafka.Brokers) > 0 {
		if err := o.kafka.Validate(); err != nil {
			return usageError(stderr, "status", err, o.relay.Replication.DSN)
		}
	}
	// PostgreSQL's part has a bound of its own; the Kafka part below is
	// bounded by --kafka-timeout as a whole.
	pgCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	info, failoverWarning, err := relay.ReadSlot(pgCtx, o.relay.Replication)
	if err != nil {
		return failure(stderr, "status", err, o.relay.Replication.DSN)
	}
	report := statusReport{SlotInfo: info, Delivery: o.relay.DeliveryMode(), FailoverWarning: failoverWarning}
	if failoverWarning != "" {
		fmt.Fprintf(stderr, "outbox-relay status: warning: %s\n", failoverWarning)
	}
	if len(o.kafka.Brokers) == 0 && o.relay.DeliveryMode() == relay.DeliveryExactlyOnce {
		fmt.Fprintln(stderr, "outbox-relay status: pass --kafka-brokers to show the last committed progress: in exactly-once mode it is kept in Kafka")
	}
	if len(o.kafka.Brokers) > 0 {
		report.Progress, err = progressReport(ctx, o.relayConfig(zerolog.Nop()), info)
		if err != nil {
			fmt.Fprintf(stderr, "outbox-relay status: %s\n", operatorMessage(err, o.relay.Replication.DSN))
			return exitFailure
		}
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	enc.Encode(report)
	return exitOK
}
