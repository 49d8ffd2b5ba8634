package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
)

// version is stamped at build time with -ldflags "-X main.version=...".
var version = "dev"

const usage = `usage: outbox-relay <command> [flags]

commands:
  run       stream committed outbox rows to Kafka
  migrate   create the outbox table, its publication and the replication slot
  status    print the slot's state from PostgreSQL (needs no running relay)
  quarantine list | replay <event_id>... | replay --all
            show or re-publish events Kafka refused
  version   print the version

Run 'outbox-relay <command> -h' for a command's flags. Every flag can also be
set as OUTBOX_RELAY_<FLAG> (upper case, '-' as '_') or in a --config YAML file.
`

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1 // the relay stopped on an error it cannot retry
	exitUsage   = 2 // bad flags or configuration
)

// run dispatches a command and maps its outcome to an exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	commands := map[string]func(context.Context, []string, io.Writer, io.Writer) int{
		"run": runCommand, "migrate": migrateCommand, "status": statusCommand, "quarantine": quarantineCommand,
	}
	switch args[0] {
	case "version", "--version", "-version":
		fmt.Fprintf(stdout, "outbox-relay %s\n", version)
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
	return cmd(ctx, args[1:], stdout, stderr)
}

// setup parses a command's flags; on failure it prints one line and returns
// the exit code to use.
func setup(name string, args []string, stderr io.Writer) (*options, *flag.FlagSet, int) {
	o := &options{}
	fs := newFlagSet("outbox-relay "+name, o, stderr)
	if err := parse(fs, o, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, nil, exitOK
		}
		fmt.Fprintf(stderr, "outbox-relay %s: %s\n", name, replication.RedactError(err.Error(), o.relay.Replication.DSN))
		return nil, nil, exitUsage
	}
	return o, fs, -1
}

func newLogger(level string, stderr io.Writer) (zerolog.Logger, error) {
	lvl, err := zerolog.ParseLevel(level)
	if err != nil || level == "" {
		return zerolog.Nop(), fmt.Errorf("--log-level %q: use debug, info, warn or error", level)
	}
	var out io.Writer = stderr
	if f, ok := stderr.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
		out = zerolog.ConsoleWriter{Out: stderr, TimeFormat: time.RFC3339}
	}
	return zerolog.New(out).Level(lvl).With().Timestamp().Logger(), nil
}

func fail(stderr io.Writer, name string, err error, dsn string) int {
	fmt.Fprintf(stderr, "outbox-relay %s: %s\n", name, replication.RedactError(err.Error(), dsn))
	return exitUsage
}

func runCommand(ctx context.Context, args []string, _, stderr io.Writer) int {
	o, _, code := setup("run", args, stderr)
	if o == nil {
		return code
	}
	log, err := newLogger(o.logLevel, stderr)
	if err != nil {
		return fail(stderr, "run", err, "")
	}
	if err := o.relay.Validate(); err != nil {
		return fail(stderr, "run", err, o.relay.Replication.DSN)
	}

	o.relay.Progress.RelayVersion = version
	gcPercent, memoryLimit := tuneGC(o.relay, os.Getenv)
	registry := prometheus.NewRegistry()
	metrics := relay.NewMetrics(registry)
	notifier := newSystemdNotifier(log)
	r := relay.New(o.relay, log, metrics, relay.Hooks{Streaming: notifier.ready, Alive: notifier.alive})
	notifier.watch(ctx, r.Status, o.relay)

	if o.adminAddr != "" {
		ln, err := net.Listen("tcp", o.adminAddr)
		if err != nil {
			return fail(stderr, "run", fmt.Errorf("--admin-addr %s: %w (choose a free address, or empty to disable)", o.adminAddr, err), "")
		}
		srv := &http.Server{Handler: r.AdminHandler(registry), ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(ln)
		defer srv.Close()
		log.Info().Str("admin_addr", ln.Addr().String()).Msg("admin endpoint listening")
	}
	log.Info().Str("version", version).Str("postgres", replication.Describe(o.relay.Replication.DSN)).
		Strs("kafka_brokers", o.relay.Publisher.Brokers).Str("table", o.relay.Replication.Table).
		Str("topic", o.relay.Publisher.TopicTemplate).Int("gogc", gcPercent).Int64("gomemlimit", memoryLimit).Msg("starting")

	if err := r.Run(ctx); err != nil {
		notifier.stopping()
		log.Error().Msg(replication.RedactError(err.Error(), o.relay.Replication.DSN))
		return exitFailure
	}
	notifier.stopping()
	return exitOK
}

func migrateCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o := &options{}
	fs := newFlagSet("outbox-relay migrate", o, stderr)
	printSQL := fs.Bool("print-sql", false, "print the SQL (without the slot) and exit, for teams that run their own migration tool")
	skipSlot := fs.Bool("skip-slot", false, "do not create the replication slot (create it later with the relay's role)")
	slotOnly := fs.Bool("slot-only", false, "only create the replication slot (run as the relay's REPLICATION role)")
	if err := parse(fs, o, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return fail(stderr, "migrate", err, o.relay.Replication.DSN)
	}
	schema, table, err := replication.SplitTable(o.relay.Replication.Table)
	if err != nil {
		return fail(stderr, "migrate", err, "")
	}
	qSchema, qTable := quarantineTable(o)
	names := migrations.Names{Schema: schema, Table: table, Publication: o.relay.Replication.Publication,
		Quarantine: qSchema + "." + qTable}
	if *printSQL {
		script, err := migrations.SQL(names)
		if err != nil {
			return fail(stderr, "migrate", err, "")
		}
		fmt.Fprint(stdout, script)
		fmt.Fprintf(stdout, "-- the replication slot, created by the relay's role (REPLICATION):\nSELECT pg_create_logical_replication_slot('%s', 'pgoutput');\n", o.relay.Replication.Slot)
		return exitOK
	}
	if err := o.relay.Replication.Validate(); err != nil {
		return fail(stderr, "migrate", err, o.relay.Replication.DSN)
	}
	log, err := newLogger(o.logLevel, stderr)
	if err != nil {
		return fail(stderr, "migrate", err, "")
	}
	admin, err := replication.Connect(ctx, o.relay.Replication)
	if err != nil {
		return fail(stderr, "migrate", err, o.relay.Replication.DSN)
	}
	defer admin.Close(context.Background())
	if !*slotOnly {
		if err := migrations.Apply(ctx, admin.Conn(), names); err != nil {
			return fail(stderr, "migrate", err, o.relay.Replication.DSN)
		}
		log.Info().Str("table", o.relay.Replication.Table).Str("publication", o.relay.Replication.Publication).Msg("schema is up to date")
	}
	if *skipSlot {
		return exitOK
	}
	if err := admin.Check(ctx); err != nil {
		return fail(stderr, "migrate", fmt.Errorf("before creating the slot: %w", err), o.relay.Replication.DSN)
	}
	info, exists, err := admin.Slot(ctx)
	if err != nil {
		return fail(stderr, "migrate", err, o.relay.Replication.DSN)
	}
	if exists {
		if err := admin.CheckSlot(ctx, info); err != nil {
			return fail(stderr, "migrate", err, o.relay.Replication.DSN)
		}
		log.Info().Str("slot", info.Name).Msg("replication slot exists")
		return exitOK
	}
	at, err := admin.CreateSlot(ctx)
	if err != nil {
		return fail(stderr, "migrate", err, o.relay.Replication.DSN)
	}
	log.Info().Str("slot", o.relay.Replication.Slot).Str("lsn", at.String()).
		Msg("created the replication slot; every event committed from now on will be published")
	return exitOK
}

func statusCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, _, code := setup("status", args, stderr)
	if o == nil {
		return code
	}
	if err := o.relay.Replication.Validate(); err != nil {
		return fail(stderr, "status", err, o.relay.Replication.DSN)
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	info, err := relay.ReadSlot(ctx, o.relay.Replication)
	if err != nil {
		fmt.Fprintf(stderr, "outbox-relay status: %s\n", replication.RedactError(err.Error(), o.relay.Replication.DSN))
		return exitFailure
	}
	report := statusReport{SlotInfo: info}
	if len(o.relay.Publisher.Brokers) > 0 {
		report.Progress, err = progressReport(ctx, o.relay, info)
		if err != nil {
			fmt.Fprintf(stderr, "outbox-relay status: %s\n", replication.RedactError(err.Error(), o.relay.Replication.DSN))
			return exitFailure
		}
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	enc.Encode(report)
	return exitOK
}
