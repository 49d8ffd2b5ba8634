// Command bench measures the relay against the targets of the "Make it fast"
// issue: throughput against the pg_recvlogical ceiling, CPU per event, peak
// memory, commit-to-ack latency and allocations per event. It writes
// Markdown and JSON to bench/runs/ (not tracked by git) and appends a line
// to bench/runs/history.md. See test/bench/README.md.
//
// It is a program, not a test, so `go test ./...` never runs it:
//
//	go run ./test/bench [--rows 100000] [--broker kfake|apache|both] [--note "..."]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// options are the command line.
type options struct {
	rows          int
	broker        string
	note          string
	out           string
	history       string
	repeat        int
	partitions    int
	aggregates    int
	payload       int
	prefillConns  int
	latencyFor    time.Duration
	rates         string
	writers       int
	skip          map[string]bool
	relayBin      string
	profileDir    string
	pgFsync       bool
	apacheJVM     string
	linger        time.Duration
	compression   string
	extraRelayArg string
	logDir        string
	latencyDump   string
	variants      []variant
	steadyRates   string
	steadyFor     time.Duration
	steadyWarm    time.Duration
	steadyWriters int
	floorLingers  []time.Duration
	quick         bool
	reconcileRows int
	writerEvents  int
	shapes        string
	pollRates     string
	pollRows      int
	pollIdle      time.Duration
	inboxEvents   int
	tracingRows   int
}

// variant is one relay build measured side by side with the others on the
// same backlogs: drains alternate between variants within each repetition.
type variant struct {
	name string
	bin  string   // empty: the default binary
	env  []string // extra environment
}

func parseOptions(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.IntVar(&o.rows, "rows", 1_000_000, "backlog size in outbox rows for each transaction shape; the large transaction has twice as many")
	fs.StringVar(&o.broker, "broker", "", "kfake, apache or both (default: both when Apache Kafka can start here, else kfake)")
	fs.StringVar(&o.note, "note", "", "free text recorded with the run in history.md (what changed)")
	fs.StringVar(&o.out, "out", "bench/runs", "directory for latest.md, latest.json, timestamped copies and history.md (relative to the module root; bench/runs is not tracked by git)")
	fs.StringVar(&o.history, "history", "", "append the run's summary line to this file instead of history.md in --out, e.g. bench/results/history.md to publish it (relative to the module root)")
	fs.IntVar(&o.repeat, "repeat", 1, "how many times each drain is measured on the same backlog (each on its own slot)")
	fs.IntVar(&o.partitions, "partitions", 6, "partitions of each benchmark topic")
	fs.IntVar(&o.aggregates, "aggregates", 10000, "distinct aggregate_id values")
	fs.IntVar(&o.payload, "payload", 300, "payload size in bytes (jsonb text)")
	fs.IntVar(&o.prefillConns, "prefill-conns", 2, "connections filling the backlog in parallel")
	fs.DurationVar(&o.latencyFor, "latency-duration", 15*time.Second, "how long each live-latency rate runs")
	fs.StringVar(&o.rates, "rates", "1000,5000,max", "live-latency commit rates per second; max = as fast as the writers go")
	fs.IntVar(&o.writers, "writers", 4, "writer connections for the live-latency part (twice as many for max)")
	fs.IntVar(&o.reconcileRows, "reconcile-rows", 1_000_000, "rows in the window of the reconcile part")
	fs.IntVar(&o.writerEvents, "writer-events", 200_000, "events each mode of the writer part writes")
	fs.IntVar(&o.inboxEvents, "inbox-events", 30_000, "backlog each consumer of the inbox part drains")
	fs.IntVar(&o.tracingRows, "tracing-rows", 300_000, "backlog each setting of the tracing part drains (tracing off, on, sampled 1%)")
	fs.StringVar(&o.steadyRates, "steady-rates", "500,2000,5000", "commit rates per second of the steady-rate part")
	fs.DurationVar(&o.steadyFor, "steady-duration", 15*time.Second, "measured length of each steady-rate run (after a warm-up at the same rate)")
	fs.DurationVar(&o.steadyWarm, "steady-warmup", 2*time.Second, "warm-up at the same rate before each steady-rate measurement")
	fs.IntVar(&o.steadyWriters, "steady-writers", 0, "writer connections of the steady-rate part (default: enough for the rate, at least 2)")
	fs.Func("steady-floor-lingers", "comma-separated lingers of the steady-rate producer floors, e.g. 0,2ms (default: the relay's, or --linger)", func(v string) error {
		for _, s := range strings.Split(v, ",") {
			d, err := time.ParseDuration(strings.TrimSpace(s))
			if err != nil || d < 0 {
				return fmt.Errorf("%q is not a linger", s)
			}
			o.floorLingers = append(o.floorLingers, d)
		}
		return nil
	})
	fs.BoolVar(&o.quick, "quick", false, "reduced run: --rows 100000, --reconcile-rows 100000, 5 s latency runs, 6 s steady runs, no large transaction (explicit flags still win)")
	fs.StringVar(&o.pollRates, "poll-rates", "500,2000", "commit rates per second of the poll part (polling or CDC, side by side)")
	fs.IntVar(&o.pollRows, "poll-rows", 0, "catch-up backlog of the poll part (default: --rows)")
	fs.DurationVar(&o.pollIdle, "poll-idle", 30*time.Second, "idle period at the end of each source in the poll part")
	fs.StringVar(&o.shapes, "shapes", "single,batch100", "comma-separated catch-up shapes to measure: single (single-row transactions), batch100 (100-row transactions)")
	skip := fs.String("skip", "", "comma-separated parts to skip: "+strings.Join(parts, ", ")+" (floor: both floors)")
	fs.StringVar(&o.relayBin, "relay-bin", "", "use this relay binary instead of building ./cmd/outbox-relay")
	fs.StringVar(&o.profileDir, "profile", "", "also drain each backlog with the relay in-process under pprof, at-least-once and exactly-once, writing CPU, allocation and peak heap profiles here")
	fs.BoolVar(&o.pgFsync, "pg-fsync", false, "run the benchmark's PostgreSQL with fsync=on (default off, so disk flushes stay out of commit-to-ack)")
	fs.StringVar(&o.apacheJVM, "apache-jvm", "server", "server: the Apache Kafka broker runs with the JVM's own JIT and GC, as in production; lean: C1 only and the serial collector, as in the tests")
	fs.DurationVar(&o.linger, "linger", -1, "set the in-process relay's and the producer floor's linger (default: the relay's own default)")
	fs.StringVar(&o.compression, "compression", "", "pass --compression to the relay (default: the relay's own default)")
	fs.StringVar(&o.extraRelayArg, "relay-args", "", "extra space-separated flags for the relay subprocess")
	fs.StringVar(&o.latencyDump, "latency-dump", "", "write every latency observation (ack time, latency) as CSV files into this directory")
	fs.StringVar(&o.logDir, "logs", "", "keep the relay subprocesses' logs in this directory (default: a temporary one, deleted)")
	fs.Func("variant", "NAME=BIN[,KEY=VALUE...]: measure this relay binary (with this extra environment) side by side with the others, on the same backlogs; repeatable. Without it the one relay is the default binary", func(v string) error {
		name, rest, ok := strings.Cut(v, "=")
		if !ok || name == "" || strings.ContainsAny(name, " /|") {
			return fmt.Errorf("want NAME=BIN[,KEY=VALUE...]")
		}
		parts := strings.Split(rest, ",")
		vr := variant{name: name, bin: parts[0], env: parts[1:]}
		for _, kv := range vr.env {
			if !strings.Contains(kv, "=") {
				return fmt.Errorf("variant %s: %q is not KEY=VALUE", name, kv)
			}
		}
		o.variants = append(o.variants, vr)
		return nil
	})
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.quick {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["rows"] {
			o.rows = 100_000
		}
		if !set["latency-duration"] {
			o.latencyFor = 5 * time.Second
		}
		if !set["steady-duration"] {
			o.steadyFor = 6 * time.Second
		}
		if !set["reconcile-rows"] {
			o.reconcileRows = 100_000
		}
		if !set["writer-events"] {
			o.writerEvents = 20_000
		}
		if !set["tracing-rows"] {
			o.tracingRows = 50_000
		}
		if !set["skip"] {
			*skip = "bigtxn"
		}
		if !set["poll-idle"] {
			o.pollIdle = 10 * time.Second
		}
	}
	if o.reconcileRows < plantedEvery {
		return nil, fmt.Errorf("--reconcile-rows %d: at least %d", o.reconcileRows, plantedEvery)
	}
	if o.pollRows == 0 {
		o.pollRows = o.rows
	}
	if _, err := o.pollRateList(); err != nil {
		return nil, err
	}
	if o.rows < 1000 {
		return nil, fmt.Errorf("--rows %d: at least 1000", o.rows)
	}
	if o.apacheJVM != "server" && o.apacheJVM != "lean" {
		return nil, fmt.Errorf("--apache-jvm %q: server or lean", o.apacheJVM)
	}
	if o.repeat < 1 || o.repeat > 3 {
		return nil, fmt.Errorf("--repeat %d: 1 to 3", o.repeat)
	}
	switch o.broker {
	case "", "kfake", "apache", "both":
	default:
		return nil, fmt.Errorf("--broker %q: kfake, apache or both", o.broker)
	}
	o.skip = map[string]bool{}
	for _, s := range strings.Split(*skip, ",") {
		s = strings.TrimSpace(s)
		switch {
		case s == "":
		case slices.Contains(parts, s):
			o.skip[s] = true
		default:
			return nil, fmt.Errorf("--skip %q: one of %s", s, strings.Join(parts, ", "))
		}
	}
	if _, err := o.shapeList(); err != nil {
		return nil, err
	}
	if _, err := o.rateList(); err != nil {
		return nil, err
	}
	if _, err := o.steadyRateList(); err != nil {
		return nil, err
	}
	if o.steadyFor < time.Second || o.steadyWarm < 0 {
		return nil, fmt.Errorf("--steady-duration %s, --steady-warmup %s: at least 1s and not negative", o.steadyFor, o.steadyWarm)
	}
	return o, nil
}

// parts are the parts of the benchmark that --skip can leave out.
var parts = []string{"ceiling", "bigtxn", "latency", "steady", "floor", "allocs", "reconcile", "eos", "writer", "poll", "inbox", "messages", "tracing"}

// catchUpShapes are the backlogs of the catch-up part, by their --shapes key.
func catchUpShapes() []shape {
	return []shape{{name: "single-row txns", key: "single", perTxn: 1}, {name: "100-row txns", key: "batch100", perTxn: 100}}
}

// shapeList parses --shapes, keeping the order of catchUpShapes so that runs
// with different selections still measure in the same order.
func (o *options) shapeList() ([]shape, error) {
	all := catchUpShapes()
	want := map[string]bool{}
	for _, s := range strings.Split(o.shapes, ",") {
		s = strings.TrimSpace(s)
		if !slices.ContainsFunc(all, func(sh shape) bool { return sh.key == s }) {
			return nil, fmt.Errorf("--shapes: %q is not single or batch100", s)
		}
		want[s] = true
	}
	var out []shape
	for _, sh := range all {
		if want[sh.key] {
			out = append(out, sh)
		}
	}
	return out, nil
}

// rateList parses --rates; 0 stands for max.
func (o *options) rateList() ([]int, error) {
	var out []int
	for _, s := range strings.Split(o.rates, ",") {
		s = strings.TrimSpace(s)
		if s == "max" {
			out = append(out, 0)
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("--rates: %q is not a positive number or max", s)
		}
		out = append(out, n)
	}
	return out, nil
}

// steadyRateList parses --steady-rates.
func (o *options) steadyRateList() ([]int, error) {
	return positiveList("--steady-rates", o.steadyRates)
}

func (o *options) pollRateList() ([]int, error) { return positiveList("--poll-rates", o.pollRates) }

// positiveList parses a comma-separated list of positive numbers.
func positiveList(flag, list string) ([]int, error) {
	var out []int
	for _, s := range strings.Split(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("%s: %q is not a positive number", flag, s)
		}
		out = append(out, n)
	}
	return out, nil
}

func main() {
	// The bench runs kfake and the bare producer floors as child processes
	// of its own binary, so their CPU is their own.
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case childKfake:
			os.Exit(runKfakeChild(os.Args[2:]))
		case childFloor:
			os.Exit(runFloorChild(os.Args[2:]))
		}
	}
	o, err := parseOptions(os.Args[1:])
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	b := &bench{o: o, started: time.Now()}
	err = b.run(ctx)
	b.cleanup()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// bench is one run of the benchmark.
type bench struct {
	o       *options
	started time.Time
	root    string // module root
	res     *Results

	pg       *harness.Postgres
	brokers  []*broker
	relayBin string
	cleanups []func()
}

func (b *bench) logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[%6.1fs] %s\n", time.Since(b.started).Seconds(), fmt.Sprintf(format, args...))
}

func (b *bench) defer_(fn func()) { b.cleanups = append(b.cleanups, fn) }

func (b *bench) cleanup() {
	for i := len(b.cleanups) - 1; i >= 0; i-- {
		b.cleanups[i]()
	}
	b.cleanups = nil
}

func (b *bench) run(ctx context.Context) error {
	root, err := moduleRoot()
	if err != nil {
		return err
	}
	b.root = root
	b.res = newResults(b.o)
	b.res.Environment = environment()

	// Apache Kafka is the slow part to start: do it first, and say clearly
	// when it cannot run here.
	if err := b.startBrokers(); err != nil {
		return err
	}
	names := make([]string, len(b.brokers))
	for i, br := range b.brokers {
		names[i] = br.name
	}
	b.res.Brokers = names

	if !b.o.skip["ceiling"] || !b.o.skip["bigtxn"] || !b.o.skip["latency"] || !b.o.skip["steady"] || !b.o.skip["reconcile"] || !b.o.skip["eos"] || !b.o.skip["writer"] || !b.o.skip["inbox"] || !b.o.skip["tracing"] || b.o.profileDir != "" {
		if err := b.startPostgres(); err != nil {
			return err
		}
	}
	if !b.o.skip["ceiling"] || !b.o.skip["bigtxn"] || !b.o.skip["steady"] || !b.o.skip["reconcile"] || !b.o.skip["eos"] || !b.o.skip["poll"] || !b.o.skip["messages"] || !b.o.skip["tracing"] {
		if err := b.buildRelay(); err != nil {
			return err
		}
	}
	if !b.o.skip["allocs"] {
		b.logf("allocations: go test -bench BenchmarkDecodeAndBuild ./relay/")
		a, err := runGoBench(ctx, b.root)
		if err != nil {
			b.logf("allocations benchmark failed: %v", err)
			b.res.Problems = append(b.res.Problems, fmt.Sprintf("allocations benchmark: %v", err))
		}
		b.res.Allocs = a
	}
	if !b.o.skip["ceiling"] || b.o.profileDir != "" {
		shapes, err := b.o.shapeList()
		if err != nil {
			return err
		}
		for _, shape := range shapes {
			if err := ctx.Err(); err != nil {
				return err
			}
			sr, err := b.ceiling(ctx, shape)
			if err != nil {
				return fmt.Errorf("ceiling, %s: %w", shape.name, err)
			}
			b.res.Ceiling = append(b.res.Ceiling, sr)
		}
	}
	if !b.o.skip["bigtxn"] {
		bt, err := b.bigTxn(ctx)
		if err != nil {
			return fmt.Errorf("large transaction: %w", err)
		}
		b.res.BigTxn = bt
	}
	// The floor runs first: it also warms the broker (JIT, page cache) for
	// the live latency.
	if !b.o.skip["floor"] {
		fr, err := b.eachBroker(ctx, "producer floor", b.producerFloor)
		if err != nil {
			return err
		}
		b.res.Floor = fr
	}
	if !b.o.skip["latency"] {
		lr, err := b.eachBroker(ctx, "latency", b.latency)
		if err != nil {
			return err
		}
		b.res.Latency = lr
	}
	if !b.o.skip["steady"] {
		sr, err := b.steady(ctx)
		b.res.Steady = sr
		if err != nil {
			return fmt.Errorf("steady rate: %w", err)
		}
	}
	if !b.o.skip["eos"] {
		er, err := b.eosLatency(ctx)
		b.res.EOS = er
		if err != nil {
			return fmt.Errorf("exactly-once latency: %w", err)
		}
	}
	if !b.o.skip["reconcile"] {
		for _, br := range b.brokers {
			rr, err := b.reconcileWindow(ctx, br)
			if err != nil {
				return fmt.Errorf("reconcile, %s: %w", br.name, err)
			}
			b.res.Reconcile = append(b.res.Reconcile, rr)
		}
	}
	if !b.o.skip["writer"] {
		wr, err := b.writerPart(ctx)
		b.res.Writer = wr
		if err != nil {
			return err
		}
	}
	if !b.o.skip["inbox"] {
		ir, err := b.inboxPart(ctx)
		b.res.Inbox = ir
		if err != nil {
			return fmt.Errorf("inbox part: %w", err)
		}
	}
	if !b.o.skip["poll"] {
		pr, err := b.pollCompare(ctx)
		b.res.Poll = pr
		if err != nil {
			return fmt.Errorf("poll part: %w", err)
		}
	}
	if !b.o.skip["messages"] {
		mr, err := b.messagesCompare(ctx)
		b.res.Messages = mr
		if err != nil {
			return fmt.Errorf("messages part: %w", err)
		}
	}
	if !b.o.skip["tracing"] {
		tr, err := b.tracingPart(ctx)
		b.res.Tracing = tr
		if err != nil {
			return fmt.Errorf("tracing part: %w", err)
		}
	}
	b.res.Duration = time.Since(b.started).Round(time.Second).String()
	return b.write()
}

// eachBroker runs one latency part on every broker in turn.
func (b *bench) eachBroker(ctx context.Context, part string, measure func(context.Context, *broker) (LatencyResult, error)) ([]LatencyResult, error) {
	var out []LatencyResult
	for _, br := range b.brokers {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		r, err := measure(ctx, br)
		if err != nil {
			return nil, fmt.Errorf("%s, %s: %w", part, br.name, err)
		}
		out = append(out, r)
	}
	return out, nil
}

func (b *bench) startPostgres() error {
	b.logf("starting PostgreSQL")
	settings := map[string]string{
		"autovacuum":                "off", // no WAL from autovacuum between the backlog and its end position
		"max_wal_size":              "16GB",
		"checkpoint_timeout":        "30min",
		"shared_buffers":            "256MB",
		"max_replication_slots":     "30",
		"max_wal_senders":           "30",
		"logical_decoding_work_mem": "64MB",
		"wal_sender_timeout":        "60s",
	}
	if !b.o.pgFsync {
		settings["fsync"] = "off"
	}
	pg, closePG, err := harness.StartPostgresMain(harness.PGOptions{Settings: settings})
	if err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	b.pg = pg
	b.defer_(closePG)
	return nil
}

func (b *bench) buildRelay() error {
	for i, v := range b.o.variants {
		if v.bin == "" {
			continue
		}
		abs, err := filepath.Abs(v.bin)
		if err != nil {
			return err
		}
		b.o.variants[i].bin = abs
	}
	if len(b.o.variants) == 0 {
		b.o.variants = []variant{{}}
	}
	names := []string{}
	for _, v := range b.o.variants {
		if v.name != "" {
			names = append(names, scrubPaths(fmt.Sprintf("%s = %s %s", v.name, orDefault(v.bin, "default binary"), strings.Join(v.env, " "))))
		}
	}
	b.res.Variants = names
	if b.o.relayBin != "" {
		abs, err := filepath.Abs(b.o.relayBin)
		if err != nil {
			return err
		}
		b.relayBin = abs
		b.res.RelayBinary = "given with --relay-bin"
		return nil
	}
	dir, err := os.MkdirTemp("", "outbox-relay-bench-")
	if err != nil {
		return err
	}
	b.defer_(func() { os.RemoveAll(dir) })
	b.relayBin = filepath.Join(dir, "outbox-relay")
	b.logf("building the relay")
	if err := runCmd(b.root, []string{"CGO_ENABLED=0"}, "go", "build", "-trimpath", "-o", b.relayBin, "./cmd/outbox-relay"); err != nil {
		return fmt.Errorf("build relay: %w", err)
	}
	b.res.RelayBinary = "go build -trimpath ./cmd/outbox-relay (CGO_ENABLED=0)"
	return nil
}

// environment describes the machine for the results.
func environment() Environment {
	e := Environment{GoVersion: runtime.Version(), CPUs: runtime.NumCPU()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "model name") {
				if i := strings.IndexByte(line, ':'); i >= 0 {
					e.CPUModel = strings.TrimSpace(line[i+1:])
				}
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		f := strings.Fields(string(b))
		if len(f) >= 3 {
			e.LoadAtStart = strings.Join(f[:3], " ")
		}
	}
	return e
}

func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("run the benchmark inside the module (no go.mod above the working directory)")
		}
		dir = parent
	}
}
