package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/docgen"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/poll"
	"github.com/outbox-relay/outbox-relay/reconcile"
	"github.com/outbox-relay/outbox-relay/relay"
)

// updateReference makes TestReferenceIsGenerated write the generated files
// instead of comparing them: make docs runs it with -update.
var updateReference = flag.Bool("update", false, "write the generated reference pages and man page")

// The generated files, relative to the module root.
const (
	commandsPage = "docs/reference/commands.md"
	flagsPage    = "docs/reference/flags.md"
	runFlagsPage = "docs/reference/run-flags.md"
	metricsPage  = "docs/reference/metrics.md"
	manPage      = "deploy/outbox-relay.1"
)

// referenceCLI is the CLI as the reference and the man page describe it,
// built from the commands' own flag sets.
func referenceCLI() docgen.CLI {
	cli := docgen.CLI{
		Program:   "outbox-relay",
		Summary:   "transactional-outbox relay from PostgreSQL to Kafka",
		Usage:     usage,
		EnvName:   envName,
		ListFlags: listFlagNames,
		OwnPage:   "run",
		EnvOnly: []docgen.EnvVar{
			{Name: envName("kafka-sasl-password"), Meaning: "the SASL password, when --kafka-sasl-password-file does not name a file holding it (the file wins); never a flag, so it never shows in a process list"},
			{Name: "GOGC", Meaning: fmt.Sprintf("Go's garbage collector target; when unset, run sets %d (%d with --delivery exactly-once)", gcPercent, gcPercentExactlyOnce)},
			{Name: "GOMEMLIMIT", Meaning: fmt.Sprintf("Go's soft memory limit; when unset, run sets 64 MiB plus twice --max-in-flight-bytes, and reconcile %d MiB", reconcileMemoryLimit>>20)},
			{Name: "NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID", Meaning: "set by systemd for a Type=notify unit with a watchdog: run reports READY=1, STATUS= and WATCHDOG=1 there"},
		},
		ExitCodes: []docgen.ExitCode{
			{Code: exitOK, Meaning: "success"},
			{Code: exitFailure, Meaning: "the command ran and failed (PostgreSQL or Kafka unreachable or refusing, a precondition not met): fix the environment, not the flags"},
			{Code: exitUsage, Meaning: "bad flags or configuration, found before anything was touched"},
			{Code: exitMissing, Meaning: "reconcile only: events missing from Kafka and not republished"},
		},
	}
	for _, command := range allCommands {
		cli.Commands = append(cli.Commands, docgen.Command{Name: command, Flags: newFlagSet(command, &options{}, io.Discard)})
	}
	return cli
}

// referenceMetrics is the metric reference, from the collectors the
// sources, the periodic reconcile and the inbox library register.
func referenceMetrics() ([]byte, error) {
	runtimeSeries := []string{"go_", "process_"}
	var err error
	describe := func(register func(prometheus.Registerer), skip ...string) []docgen.Metric {
		ms, derr := docgen.Describe(register, skip...)
		if derr != nil && err == nil {
			err = derr
		}
		return ms
	}
	shared := describe(func(r prometheus.Registerer) { pipeline.NewMetrics(r) }, runtimeSeries...)
	runtime := docgen.Without(describe(func(r prometheus.Registerer) { pipeline.NewMetrics(r) }), shared)
	wal := docgen.Without(describe(func(r prometheus.Registerer) { relay.NewMetrics(r) }, runtimeSeries...), shared)
	polled := docgen.Without(describe(func(r prometheus.Registerer) { poll.NewMetrics(r) }, runtimeSeries...), shared)
	checks := describe(func(r prometheus.Registerer) { reconcile.NewMetrics(r) })
	consumer := describe(func(r prometheus.Registerer) { r.MustRegister(inbox.NewMetrics("billing")) })
	if err != nil {
		return nil, fmt.Errorf("describing the metrics: %w", err)
	}
	names := make([]string, len(runtime))
	for i, m := range runtime {
		names[i] = "`" + m.Name + "`"
	}
	intro := "Every series the relay's `/metrics` endpoint and the inbox library export, generated from their collectors' descriptors. " +
		"`run` registers the series every source shares, then those of its source; `--reconcile-every` adds the periodic check's. " +
		"The alert rules in `deploy/prometheus-alerts.yaml` and the dashboard `deploy/grafana/outbox-relay.json` use them; " +
		"[the runbook](../runbook.md) says what to do when one fires."
	groups := []docgen.MetricGroup{
		{Title: "Every source", Intro: "Exported by `run` whatever its `--source`, with one meaning per name.", Metrics: shared},
		{Title: "WAL and messages sources", Intro: "Exported by `run --source wal` (the default) and `--source messages`: the slot, the stream and, with `--delivery exactly-once`, the Kafka transactions.", Metrics: wal},
		{Title: "Poll mode", Intro: "Exported by `run --source poll`.", Metrics: polled},
		{Title: "Periodic reconcile", Intro: "Exported by `run` with `--reconcile-every` (the interval series is there, at 0, without it).", Metrics: checks},
		{Title: "The inbox library", Intro: "Exported by a consumer that registers `inbox.NewMetrics(consumer)` on its own registry; `consumer` is the name it gives.", Metrics: consumer},
	}
	outro := "## Go runtime and process\n\nThe Go and process collectors of client_golang, registered beside the series every source shares: " + strings.Join(names, ", ") + "."
	return docgen.MetricsMarkdown(intro, groups, outro), nil
}

// generatedReference is every generated file by its path from the module
// root.
func generatedReference() (map[string][]byte, error) {
	cli := referenceCLI()
	metrics, err := referenceMetrics()
	if err != nil {
		return nil, err
	}
	files := []docgen.EnvVar{
		{Name: "/etc/outbox-relay/outbox-relay.yaml", Meaning: "the example configuration the Debian package installs, read with --config"},
		{Name: "/etc/outbox-relay/env", Meaning: "the secrets (PGPASSWORD, " + envName("kafka-sasl-password") + ") the systemd unit reads as its EnvironmentFile"},
		{Name: "/usr/share/outbox-relay/prometheus-alerts.yaml", Meaning: "the alert rules"},
		{Name: "/usr/share/outbox-relay/grafana/outbox-relay.json", Meaning: "the Grafana dashboard"},
		{Name: "/usr/share/doc/outbox-relay/", Meaning: "the documentation"},
	}
	return map[string][]byte{
		commandsPage: cli.Markdown("flags.md", "run-flags.md"),
		flagsPage:    cli.FlagsMarkdown("commands.md", "run-flags.md"),
		runFlagsPage: cli.OwnFlagsMarkdown("commands.md", "flags.md"),
		metricsPage:  metrics,
		manPage:      cli.ManPage(files, "systemctl(1), journalctl(1); the documentation in /usr/share/doc/outbox-relay"),
	}, nil
}

// TestReferenceIsGenerated fails when a generated reference page or the
// man page differs from what the code generates: a flag or metric added
// without `make docs`. With -update it writes them.
func TestReferenceIsGenerated(t *testing.T) {
	files, err := generatedReference()
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join("..", "..")
	for path, want := range files {
		full := filepath.Join(root, path)
		if *updateReference {
			if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(full, want, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(full)
		if err != nil {
			t.Errorf("%s: %v; run make docs", path, err)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s is not what the code generates (a flag or metric changed): run make docs and commit the result", path)
		}
	}
}

// TestReferenceNamesEveryFlagAndMetric checks the generator against the
// code from the other side: every flag of every command, its environment
// variable, and every series a registry gathers appear in the pages.
func TestReferenceNamesEveryFlagAndMetric(t *testing.T) {
	files, err := generatedReference()
	if err != nil {
		t.Fatal(err)
	}
	flags, metrics, man := string(files[flagsPage])+string(files[runFlagsPage]), string(files[metricsPage]), string(files[manPage])
	for _, command := range allCommands {
		newFlagSet(command, &options{}, io.Discard).VisitAll(func(f *flag.Flag) {
			for _, s := range []string{"`--" + f.Name + "`", "`" + envName(f.Name) + "`"} {
				if !strings.Contains(flags, s) {
					t.Errorf("%s: %s of %s is missing", flagsPage, s, command)
				}
			}
			if !strings.Contains(man, `.B \-\-`+strings.ReplaceAll(f.Name, "-", `\-`)) {
				t.Errorf("%s: --%s of %s is missing", manPage, f.Name, command)
			}
		})
	}
	// What a scrape of run's registry shows, whichever source.
	reg := prometheus.NewRegistry()
	relay.NewMetrics(reg)
	reconcile.NewMetrics(reg)
	pollReg := prometheus.NewRegistry()
	poll.NewMetrics(pollReg)
	inboxReg := prometheus.NewRegistry()
	inboxReg.MustRegister(inbox.NewMetrics("billing"))
	for _, g := range []prometheus.Gatherer{reg, pollReg, inboxReg} {
		families, err := g.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range families {
			if !strings.Contains(metrics, "`"+mf.GetName()+"`") {
				t.Errorf("%s: %s is missing", metricsPage, mf.GetName())
			}
		}
	}
}

// TestManPageFormats runs the man page through man, where it is installed,
// so that a roff mistake shows as a warning here.
func TestManPageFormats(t *testing.T) {
	if _, err := exec.LookPath("man"); err != nil {
		t.Skip("man is not installed")
	}
	files, err := generatedReference()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "outbox-relay.1")
	if err := os.WriteFile(path, files[manPage], 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("man", "--warnings", "-l", path)
	cmd.Env = append(os.Environ(), "MANWIDTH=100", "MANPAGER=cat", "PAGER=cat")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("man -l: %v\n%s", err, out)
	}
	text := string(out)
	for _, want := range []string{"EXIT STATUS", "--pg-dsn", "OUTBOX_RELAY_PG_DSN"} {
		if !strings.Contains(text, want) {
			t.Errorf("the formatted man page lacks %q", want)
		}
	}
	if strings.Contains(text, "warning:") {
		t.Errorf("man warns about the page:\n%s", text)
	}
}
