package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/reconcile"
	"github.com/outbox-relay/outbox-relay/store"
)

// defaultSettle is how long before now a window ends by default: rows
// younger than this may still be on their way to Kafka, or belong to a
// transaction that has not committed yet.
const defaultSettle = time.Minute

// reconcileOptions are the flags of the reconcile command, and of run's
// periodic check.
type reconcileOptions struct {
	since, until string
	republish    bool
	asJSON       bool
	margin       time.Duration
	stall        time.Duration
	ackTimeout   time.Duration
	progress     time.Duration

	every, window, settle time.Duration // run --reconcile-*
}

func reconcileFlags(fs *flag.FlagSet, o *options) {
	r := &o.reconcile
	fs.StringVar(&r.since, "since", "", "start of the window, as a duration ago (e.g. 2h) or RFC 3339 time (required)")
	fs.StringVar(&r.until, "until", defaultSettle.String(), "end of the window, as a duration ago or RFC 3339 time; the default leaves rows still on their way out")
	fs.BoolVar(&r.republish, "republish", false, "send the missing events again through the same path as run")
	fs.BoolVar(&r.asJSON, "json", false, "print the report as JSON, with every missing event id")
	fs.DurationVar(&r.margin, "margin", 5*time.Minute, "read Kafka from this long before --since; covers clock skew between PostgreSQL and the relay's host")
	fs.DurationVar(&r.stall, "stall-timeout", time.Minute, "fail when a partition delivers nothing this long before its end")
	fs.DurationVar(&r.ackTimeout, "ack-timeout", 2*time.Minute, "with --republish: how long to wait for Kafka's acknowledgements")
	fs.DurationVar(&r.progress, "progress-interval", 10*time.Second, "how often progress is logged when stderr is not a terminal")
}

func periodicReconcileFlags(fs *flag.FlagSet, o *options) {
	r := &o.reconcile
	fs.DurationVar(&r.every, "reconcile-every", 0, "compare the outbox with Kafka this often in the background and export the result as metrics (0: never); it never republishes")
	fs.DurationVar(&r.window, "reconcile-window", time.Hour, "how far back each background comparison looks")
	fs.DurationVar(&r.settle, "reconcile-settle", defaultSettle, "each background window ends this long before the check; longer than your longest transaction")
}

func (r *reconcileOptions) validatePeriodic() error {
	switch {
	case r.every < 0:
		return errors.New("--reconcile-every must not be negative")
	case r.every > 0 && r.window <= 0:
		return errors.New("--reconcile-window must be positive")
	case r.settle < 0:
		return errors.New("--reconcile-settle must not be negative")
	}
	return nil
}

func reconcileCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, _, code := setup("reconcile", args, 0, stderr)
	if o == nil {
		return code
	}
	// reconcile reads the outbox table whatever --source says, so it
	// refuses only a source that has no table.
	if source, ok := lookupSource(o.source); ok && source.noTable != "" {
		return usageError(stderr, "reconcile", fmt.Errorf("--source %s: %s", source.name, source.noTable), "")
	}
	f := &o.reconcile
	since, until, err := parseWindow(f.since, f.until, time.Now())
	if err == nil && f.margin < 0 {
		err = errors.New("--margin must not be negative")
	}
	if err == nil {
		// The same checks as run: reconcile reads and publishes with run's
		// settings, and the flags it does not take keep their valid defaults.
		// It neither reads nor writes progress, so a --progress-topic it
		// does not take must not refuse its --topic.
		o.relay.Progress.Topic = ""
		err = validateRun(o, o.relayConfig(zerolog.Nop()))
	}
	if err != nil {
		return usageError(stderr, "reconcile", err, o.relay.Replication.DSN)
	}
	log, err := newLogger(o.logLevel, stderr)
	if err != nil {
		return usageError(stderr, "reconcile", err, "")
	}

	tuneReconcileGC(os.Getenv)
	cfg := reconcileConfig(o, log)
	cfg.Since, cfg.Until = since, until
	cfg.Margin, cfg.Stall = f.margin, f.stall
	cfg.Republish = reconcile.Republish{Enabled: f.republish, Quarantine: o.relay.OnPermanentError == pipeline.OnPermanentQuarantine,
		AckTimeout: f.ackTimeout}
	bar := newProgressBar(stderr)
	cfg.Progress, cfg.ProgressEvery = bar.update(log), f.progress
	if bar.terminal {
		cfg.ProgressEvery = 200 * time.Millisecond
	}

	rep, err := reconcile.Run(ctx, cfg, log)
	bar.clear()
	if err != nil {
		return failure(stderr, "reconcile", err, o.relay.Replication.DSN)
	}
	if f.asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		enc.Encode(rep)
	} else {
		printReport(stdout, rep, f.republish)
	}
	if rep.Unrepaired() > 0 {
		return exitMissing
	}
	return exitOK
}

// reconcileConfig is the comparison's configuration from the shared flags,
// which validateRun has checked.
func reconcileConfig(o *options, log zerolog.Logger) reconcile.Config {
	quarantine, _ := store.QuarantineTable(o.relay.Replication.Table, o.relay.QuarantineTable)
	return reconcile.Config{Postgres: o.relay.Replication.Config, Kafka: o.kafkaConfig(log),
		Quarantine: quarantine, Margin: 5 * time.Minute, Stall: time.Minute}
}

// parseWindow reads --since and --until.
func parseWindow(sinceFlag, untilFlag string, now time.Time) (since, until time.Time, err error) {
	if since, err = parseWindowEdge("--since", sinceFlag, now); err != nil {
		return since, until, err
	}
	if until, err = parseWindowEdge("--until", untilFlag, now); err != nil {
		return since, until, err
	}
	if !since.Before(until) {
		return since, until, fmt.Errorf("--since %s is not before --until %s: the window is empty", sinceFlag, untilFlag)
	}
	return since, until, nil
}

// parseWindowEdge reads a duration ago ("90m") or an RFC 3339 time.
func parseWindowEdge(flagName, v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, fmt.Errorf("%s is required: a duration ago (e.g. 2h) or an RFC 3339 time", flagName)
	}
	if d, err := time.ParseDuration(v); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("%s %s: a duration counts back from now and must not be negative", flagName, v)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return time.Time{}, fmt.Errorf("%s %q: want a duration ago (e.g. 2h) or an RFC 3339 time (e.g. 2026-11-29T21:00:00Z)", flagName, v)
	}
	return t, nil
}

// printReport writes the human-readable report.
func printReport(w io.Writer, rep *reconcile.Report, republished bool) {
	const shown = 20
	fmt.Fprintf(w, "window            %s .. %s\n", rep.Since.Format(time.RFC3339), rep.Until.Format(time.RFC3339))
	fmt.Fprintf(w, "topics            %s\n", strings.Join(rep.Topics, ", "))
	fmt.Fprintf(w, "rows checked      %d\n", rep.RowsChecked)
	fmt.Fprintf(w, "found in kafka    %d (%d records read)\n", rep.Found, rep.RecordsScanned)
	fmt.Fprintf(w, "missing           %d\n", len(rep.Missing))
	listIDs(w, rep.Missing, shown)
	fmt.Fprintf(w, "delivered >1 time %d\n", len(rep.Duplicated))
	listIDs(w, rep.Duplicated, shown)
	fmt.Fprintf(w, "quarantined       %d (not missing; see `outbox-relay quarantine list`)\n", len(rep.Quarantined))
	if len(rep.ReplayedNotFound) > 0 {
		fmt.Fprintf(w, "replayed          %d (quarantine replay delivered them, but their records were not read back; not missing, never republished; see `outbox-relay quarantine list --replayed`)\n", len(rep.ReplayedNotFound))
		listIDs(w, rep.ReplayedNotFound, shown)
	}
	fmt.Fprintf(w, "phantoms          %d (records with no row; reported, never deleted)\n", len(rep.Phantoms))
	for i, p := range rep.Phantoms {
		if i == shown {
			fmt.Fprintf(w, "  ... and %d more (--json lists all)\n", len(rep.Phantoms)-shown)
			break
		}
		fmt.Fprintf(w, "  %s  %s/%d@%d  %s\n", p.EventID, p.Topic, p.Partition, p.Offset, p.Timestamp.Format(time.RFC3339Nano))
	}
	if len(rep.MissingTopics) > 0 {
		fmt.Fprintf(w, "topics not in kafka %s\n", strings.Join(rep.MissingTopics, ", "))
	}
	if len(rep.TruncatedPartitions) > 0 {
		fmt.Fprintf(w, "WARNING: Kafka's retention deleted the start of %s; rows whose records it deleted show as missing: shorten the window\n",
			strings.Join(rep.TruncatedPartitions, ", "))
	}
	if rep.UncheckedRows > 0 {
		fmt.Fprintf(w, "unchecked rows    %d (event_id is not a uuid)\n", rep.UncheckedRows)
	}
	if rep.UnidentifiedRecords > 0 {
		fmt.Fprintf(w, "unidentified      %d (records without a uuid event_id header)\n", rep.UnidentifiedRecords)
	}
	if republished && len(rep.Missing) > 0 {
		fmt.Fprintf(w, "republished       %d of %d, acknowledged by Kafka\n", rep.Republished, len(rep.Missing))
		if len(rep.RepublishQuarantined) > 0 {
			fmt.Fprintf(w, "now quarantined   %d (Kafka will not accept them; fix the cause, then `outbox-relay quarantine replay`)\n", len(rep.RepublishQuarantined))
			listIDs(w, rep.RepublishQuarantined, shown)
		}
		for i, f := range rep.RepublishFailed {
			if i == shown {
				fmt.Fprintf(w, "  ... and %d more failures (--json lists all)\n", len(rep.RepublishFailed)-shown)
				break
			}
			fmt.Fprintf(w, "  FAILED %s: %s\n", f.EventID, f.Error)
		}
	} else if len(rep.Missing) > 0 {
		fmt.Fprintf(w, "run again with --republish to send the missing events\n")
	}
}

func listIDs(w io.Writer, ids []reconcile.EventID, shown int) {
	for i, id := range ids {
		if i == shown {
			fmt.Fprintf(w, "  ... and %d more (--json lists all)\n", len(ids)-shown)
			return
		}
		fmt.Fprintf(w, "  %s\n", id)
	}
}

// progressBar draws progress on a terminal, or logs it otherwise.
type progressBar struct {
	out      io.Writer
	terminal bool
	mu       sync.Mutex
	drawn    bool
}

func newProgressBar(stderr io.Writer) *progressBar {
	b := &progressBar{out: stderr}
	if f, ok := stderr.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
		b.terminal = true
	}
	return b
}

func (b *progressBar) update(log zerolog.Logger) func(reconcile.Progress) {
	var lastLog time.Time
	return func(p reconcile.Progress) {
		if !b.terminal {
			if time.Since(lastLog) < time.Second {
				return
			}
			lastLog = time.Now()
			ev := log.Info().Str("phase", p.Phase).Int64("done", p.Done).Int64("total", p.Total).Dur("elapsed", p.Elapsed)
			if p.WaitingOn != "" {
				ev.Str("waiting_on", "kafka: "+p.WaitingOn).Msg("reconcile progress: waiting on Kafka")
				return
			}
			ev.Msg("reconcile progress")
			return
		}
		b.mu.Lock()
		defer b.mu.Unlock()
		b.drawn = true
		fmt.Fprintf(b.out, "\r%s\033[K", renderBar(p, 30))
	}
}

func (b *progressBar) clear() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.drawn {
		fmt.Fprint(b.out, "\r\033[K")
	}
}

// renderBar draws "kafka [=====>      ]  45%  450000/1000000  12s".
func renderBar(p reconcile.Progress, width int) string {
	waiting := ""
	if p.WaitingOn != "" {
		waiting = "  waiting on kafka: " + p.WaitingOn
	}
	if p.Total <= 0 {
		return fmt.Sprintf("%-9s %d  %s%s", p.Phase, p.Done, p.Elapsed.Round(time.Second), waiting)
	}
	frac := min(float64(p.Done)/float64(p.Total), 1)
	filled := int(frac * float64(width))
	bar := strings.Repeat("=", filled)
	if filled < width {
		bar += ">" + strings.Repeat(" ", width-filled-1)
	}
	return fmt.Sprintf("%-9s [%s] %3.0f%%  %d/%d  %s%s", p.Phase, bar, frac*100, p.Done, p.Total, p.Elapsed.Round(time.Second), waiting)
}

// startPeriodicReconcile runs the background comparison on its own
// goroutine; wait returns once it stopped after ctx ended.
func startPeriodicReconcile(ctx context.Context, o *options, reg prometheus.Registerer, log zerolog.Logger) (wait func()) {
	metrics := reconcile.NewMetrics(reg)
	p := o.reconcile
	if p.every <= 0 {
		return func() {}
	}
	checker := &reconcile.Periodic{Config: reconcileConfig(o, log), Every: p.every, Window: p.window, Settle: p.settle,
		Metrics: metrics, Log: log}
	done := make(chan struct{})
	go func() {
		defer close(done)
		checker.Run(ctx)
	}()
	return func() { <-done }
}
