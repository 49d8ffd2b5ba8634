package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/outbox-relay/outbox-relay/internal/tcpdial"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/poll"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/store"
	"github.com/outbox-relay/outbox-relay/tracing"
	"github.com/rs/zerolog"
)

// options is everything a command can be told, with the relay's defaults.
type options struct {
	relay relay.Config
	kafka publisher.Config
	// partitions is the process's mapping of keys by the recorded
	// partition counts, shared by every sink (see kafkaConfig).
	partitions *publisher.Partitions
	// throttle counts the brokers' throttle times of every Kafka client
	// of the process.
	throttle   *publisher.Throttle
	dryRun     bool
	brokers    string
	adminAddr  string
	logLevel   string
	configFile string

	saslPasswordFile string
	saslPassword     string

	// migrate
	printSQL, skipSlot, slotOnly bool
	// quarantine
	asJSON bool
	// adopt is partitions adopt's flags.
	adopt         adoptFlags
	replayAll     bool
	listReplayed  bool
	replayTimeout time.Duration
	// reconcile, and run's periodic check
	reconcile reconcileOptions

	// source is --source: the WAL path, poll mode or the messages source.
	source        string
	messagePrefix string
	poll          poll.Config
	pollExisting  string
	// the outbox table's layout, made into relay.Replication.Layout
	outboxLayout  string
	columns       [layout.NumColumns]string
	headerColumns string
	// the records' format and the CloudEvents source, set on the layout
	recordFormat      string
	contentType       string
	cloudEventsSource string
	// run's trace export, made into publisher.Config.Tracing
	tracing tracing.Config
}

// envName is the environment variable that sets a flag.
func envName(flagName string) string {
	return "OUTBOX_RELAY_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// flagGroup declares a set of related flags into fs, bound to o.
type flagGroup func(fs *flag.FlagSet, o *options)

// commandFlags lists the flag groups of a command, so each command's help
// shows only what applies to it.
func commandFlags(command string) []flagGroup {
	switch command {
	case "run":
		return []flagGroup{sourceFlag, postgresFlags, layoutFlags, slotCreationFlags, quarantineTableFlag, kafkaFlags, publishFlags, runFlags, pollFlags, deliveryFlag, progressFlags, periodicReconcileFlags, tracingFlags, logFlags}
	case "migrate":
		return []flagGroup{sourceFlag, postgresFlags, layoutFlags, slotCreationFlags, quarantineTableFlag, migrateFlags, pollMigrateFlags, logFlags}
	case "status":
		// Kafka is optional here: with --kafka-brokers, status adds the
		// progress kept in Kafka.
		return []flagGroup{sourceFlag, pollStrategyFlag, postgresFlags, layoutFlags, kafkaFlags, deliveryFlag, progressFlags}
	case "quarantine list":
		return []flagGroup{postgresFlags, layoutFlags, quarantineTableFlag, listFlags}
	case "quarantine replay":
		return []flagGroup{postgresFlags, layoutFlags, quarantineTableFlag, kafkaFlags, topicFlag, replayFlags, logFlags}
	case "reconcile":
		return []flagGroup{sourceFlag, postgresFlags, layoutFlags, quarantineTableFlag, kafkaFlags, publishFlags, reconcileFlags, logFlags}
	case "partitions show":
		return []flagGroup{postgresFlags, kafkaFlags, partitionsShowFlags}
	case "partitions adopt":
		return []flagGroup{postgresFlags, kafkaFlags, partitionsAdoptFlags}
	}
	return nil
}

// allCommands are the commands with flags; a --config file may hold the
// flags of any of them, so one file serves every command.
var allCommands = [...]string{"run", "migrate", "status", "quarantine list", "quarantine replay", "reconcile", "partitions show", "partitions adopt"}

// newFlagSet declares a command's flags. Every flag can also come from
// OUTBOX_RELAY_<NAME> and from the YAML file given by --config.
func newFlagSet(command string, o *options, stderr io.Writer) *flag.FlagSet {
	*o = options{relay: relay.DefaultConfig(), kafka: publisher.DefaultConfig(), poll: poll.DefaultConfig(), adminAddr: "127.0.0.1:9797", logLevel: "info", replayTimeout: time.Minute}
	fs := flag.NewFlagSet("outbox-relay "+command, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.configFile, "config", "", "YAML file of flag values (keys are flag names); flags and env win over it")
	for _, group := range commandFlags(command) {
		group(fs, o)
	}
	return fs
}

func postgresFlags(fs *flag.FlagSet, o *options) {
	c := &o.relay
	fs.StringVar(&c.Replication.DSN, "pg-dsn", "", "PostgreSQL connection string, libpq URL or key=value (required)")
	fs.StringVar(&c.Replication.Table, "table", c.Replication.Table, "schema-qualified outbox table; a part in double quotes may hold a dot")
	fs.StringVar(&c.Replication.Publication, "publication", c.Replication.Publication, "publication that carries the outbox table's inserts")
	fs.StringVar(&c.Replication.Slot, "slot", c.Replication.Slot, "logical replication slot name")
	fs.DurationVar(&c.Replication.DeadAfter, "pg-timeout", tcpdial.DefaultDeadAfter, "how soon a dead PostgreSQL connection (its peer gone without closing it: a NAT or load balancer that dropped it, a failed host) is noticed and made again: what the relay sent unacknowledged this long (TCP_USER_TIMEOUT, keepalives), or the replication stream silent this long although asked to answer, or a poller unable to prove it holds its lock; from 3s to 1h")
}

// layoutFlags say what the outbox table looks like and what records it
// makes, for every command that reads the table. One flag per column reads
// best in a YAML config (column-event-id: id) and names itself in errors.
func layoutFlags(fs *flag.FlagSet, o *options) {
	fs.StringVar(&o.outboxLayout, "outbox-layout", layout.NameRelay, "the outbox table's layout and the records' shape: relay (the relay's own table and records) or debezium (a Debezium outbox table, records as Debezium's Outbox Event Router makes them; see docs/debezium-migration.md)")
	for f := layout.Field(0); f < layout.NumColumns; f++ {
		name := strings.TrimPrefix(layout.Flag(f), "--")
		what := strings.ReplaceAll(strings.TrimPrefix(name, "column-"), "-", " ")
		if f == layout.CreatedAt {
			what = "the row's insert time, by which reconcile windows and retention select rows"
		}
		fs.StringVar(&o.columns[f], name, "", fmt.Sprintf("the outbox table's column for %s (default: %s in the relay layout, %s in the debezium layout)",
			what, columnDefault(layout.ShapeRelay, f), columnDefault(layout.ShapeDebezium, f)))
	}
	fs.StringVar(&o.headerColumns, "header-columns", "", "debezium layout: comma-separated columns placed as record headers, each column or column:header (like the router's table.fields.additional.placement column:header:name)")
	fs.StringVar(&o.recordFormat, "record-format", "", "the records' format, whatever the layout: relay, debezium, cloudevents (CloudEvents binary content mode: ce_ headers, the payload as the value) or cloudevents-structured (the whole CloudEvent as JSON in the value) (default: the layout's own, relay or debezium)")
	fs.StringVar(&o.contentType, "content-type", "", "the payloads' media type, such as application/x-protobuf for a bytea payload column: sent as every record's content-type header (in structured CloudEvents, datacontenttype) unless the row's headers set one (default: none; CloudEvents send application/json, text/plain or, for bytea, application/octet-stream)")
	fs.StringVar(&o.cloudEventsSource, "cloudevents-source", "", "the CloudEvents source attribute of every event, a URI reference such as https://example.com/billing or /billing/outbox (required with the cloudevents formats, refused with the others)")
}

// columnDefault is a field's default column in a shape, for help text.
func columnDefault(shape layout.Shape, f layout.Field) string {
	if c := (&layout.Layout{Shape: shape}).Column(f); c != "" {
		return c
	}
	return "none"
}

func slotCreationFlags(fs *flag.FlagSet, o *options) {
	fs.BoolVar(&o.relay.Replication.SlotFailover, "slot-failover", false, "create the slot as a failover slot (PostgreSQL 17+)")
}

func quarantineTableFlag(fs *flag.FlagSet, o *options) {
	fs.StringVar(&o.relay.QuarantineTable, "quarantine-table", "", "schema-qualified quarantine table (default: outbox_quarantine in the outbox table's schema)")
}

func kafkaFlags(fs *flag.FlagSet, o *options) {
	c := &o.kafka
	fs.StringVar(&o.brokers, "kafka-brokers", "", "comma-separated Kafka bootstrap brokers, host:port (required)")
	fs.StringVar(&c.Compression, "compression", c.Compression, "record compression: none, gzip, snappy, lz4, zstd")
	fs.StringVar(&c.KafkaVersion, "kafka-version", c.KafkaVersion, "Kafka protocol version to speak (0.11 or newer)")
	fs.IntVar(&c.MaxMessageBytes, "kafka-max-message-bytes", c.MaxMessageBytes, "largest record and per-partition batch the producer sends; keep at or below the topics' max.message.bytes")
	fs.IntVar(&c.RetryMax, "kafka-retry-max", c.RetryMax, "producer retries of a retriable error before the relay re-streams from the slot (at least 1; under --delivery exactly-once it is not used: a record gets the retries that fit in 20 s, then its Kafka transaction aborts and is re-streamed)")
	fs.DurationVar(&c.RetryBackoffMax, "kafka-retry-backoff-max", c.RetryBackoffMax, "cap of the producer's exponential retry backoff")
	fs.DurationVar(&c.Timeout, "kafka-timeout", c.Timeout, "bound on every wait for a broker: connecting, each request's answer, a metadata lookup; a broker that accepts connections and never answers fails run's attempt within about three times this (connect, then each request's answer); one-shot commands give up on connecting to Kafka (status: on its whole Kafka part) within this")
	fs.DurationVar(&c.Linger, "kafka-linger", c.Linger, "how long a batch waits for more records when no request is in flight (linger.ms); a few ms cut the broker's CPU at the cost of that much latency")
	fs.BoolVar(&c.Security.TLS, "kafka-tls", false, "connect to Kafka over TLS (certificate and host name verified)")
	fs.StringVar(&c.Security.CA, "kafka-tls-ca", "", "PEM file of the CA that signed the brokers' certificates (default: system roots)")
	fs.StringVar(&c.Security.Cert, "kafka-tls-cert", "", "client certificate PEM file, for mutual TLS")
	fs.StringVar(&c.Security.Key, "kafka-tls-key", "", "client key PEM file, for mutual TLS")
	fs.StringVar(&c.Security.ServerName, "kafka-tls-server-name", "", "name to verify in the brokers' certificates (default: the broker host)")
	fs.BoolVar(&c.Security.InsecureSkipVerify, "kafka-tls-insecure-skip-verify", false, "DANGEROUS: accept any broker certificate")
	fs.StringVar(&c.Security.SASLMechanism, "kafka-sasl-mechanism", "", "SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
	fs.StringVar(&c.Security.SASLUser, "kafka-sasl-user", "", "SASL user name")
	fs.BoolVar(&c.Security.AllowPlainWithoutTLS, "kafka-sasl-plain-without-tls", false, "DANGEROUS: allow SASL PLAIN without --kafka-tls, which sends the password in the clear")
	fs.StringVar(&o.saslPasswordFile, "kafka-sasl-password-file", "", "file holding the SASL password (or set OUTBOX_RELAY_KAFKA_SASL_PASSWORD)")
}

func runFlags(fs *flag.FlagSet, o *options) {
	c := &o.relay
	fs.BoolVar(&c.RecreateLostSlot, "recreate-lost-slot", false, "drop and recreate a slot the server invalidated; events in the lost WAL are NOT delivered")
	existingRowsFlag(fs, o, true)
	fs.StringVar(&c.OnSlotLost, "on-slot-lost", c.OnSlotLost, "what to do when the slot is invalidated, dropped, or missing after a failover: stop (and say what to run), or recover: make a new slot and republish from the outbox table every event since the progress record (back by --retention-margin) that Kafka lacks, then stream; see docs/slot-trouble.md")
	fs.IntVar(&c.MaxInFlightEvents, "max-in-flight-events", c.MaxInFlightEvents, "events sent and not yet acknowledged before reading pauses; 0: 2000 at-least-once, 50000 exactly-once (whose acks wait for each Kafka transaction's commit)")
	fs.Int64Var(&c.MaxInFlightBytes, "max-in-flight-bytes", c.MaxInFlightBytes, "record bytes sent and not yet acknowledged before reading pauses")
	fs.DurationVar(&c.ReadTick, "read-tick", c.ReadTick, "while keeping up, wait this long after a transaction before reading again, so several go out per wake-up and produce request: less CPU at steady rates for up to this much latency (0: read at once)")
	fs.DurationVar(&c.StatusInterval, "status-interval", c.StatusInterval, "how often a moved confirmed position is reported to PostgreSQL")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "how long SIGTERM waits for in-flight acks")
	fs.IntVar(&c.Replication.MaxMessageBytes, "max-message-bytes", c.Replication.MaxMessageBytes, "the largest change the relay reads into memory, a message's content or an outbox row (it holds a few copies of each); a larger message's content, or a larger row's large values, are dropped unread as they stream by and the event quarantined by reference (WAL position, size, SHA-256; a row stays in its table). At least --kafka-max-message-bytes")
	fs.DurationVar(&c.KafkaStallTimeout, "kafka-stall-timeout", c.KafkaStallTimeout, "how long events in flight may wait with no Kafka acknowledgement before /readyz says not ready and a warning is logged (again at this interval)")
	fs.DurationVar(&c.Retention.After, "retention", 0, "delete published outbox rows inserted (--column-created-at) longer ago than this, e.g. 168h (0: never); every table source keeps this one rule")
	fs.DurationVar(&c.Retention.Margin, "retention-margin", c.Retention.Margin, "WAL source: keep rows this much younger than the commit time of the confirmed position and of the progress record, so a long transaction's rows are never deleted before they are confirmed; longer than your longest transaction. --on-slot-lost recover reads the table this far back from the progress record (poll mode knows each row's publication and refuses it)")
	fs.DurationVar(&c.Retention.Interval, "retention-interval", c.Retention.Interval, "how often cleanup runs")
	fs.IntVar(&c.Retention.Batch, "retention-batch", c.Retention.Batch, "rows deleted per transaction")
	fs.BoolVar(&c.Retention.DryRun, "retention-dry-run", false, "log what cleanup would delete, delete nothing")
	fs.BoolVar(&c.Progress.Reset, "reset-progress", false, "ignore the stored progress record once, at the first start of this process, and start from the slot (after restoring a backup)")
	fs.StringVar(&c.TransactionalID, "transactional-id", "", "exactly-once producer's transactional.id (default: outbox-relay:<slot>@<system identifier>); a newer relay with the same id fences the older")
	fs.DurationVar(&c.TransactionInterval, "transaction-interval", c.TransactionInterval, "exactly-once: how long a Kafka transaction stays open before it commits at the next PostgreSQL transaction boundary; read_committed consumers wait up to this long")
	fs.StringVar(&o.adminAddr, "admin-addr", o.adminAddr, "address of the admin endpoint (/healthz, /readyz, /slot, /metrics); empty disables it")
	fs.BoolVar(&o.dryRun, "dry-run", false, "print each record (topic, partition, key, headers, value) as a JSON line on stdout instead of publishing, and write nothing anywhere: no slot moved (the WAL sources read a temporary slot of their own, so they show events committed from now on), no row claimed or marked, no quarantine row; see docs/dry-run.md")
}

// deliveryFlag is the delivery mode: run delivers in it, status shows it.
func deliveryFlag(fs *flag.FlagSet, o *options) {
	c := &o.relay
	fs.StringVar(&c.Delivery, "delivery", c.Delivery, "at-least-once, or exactly-once: each PostgreSQL transaction in one Kafka transaction with the progress record, for read_committed consumers (see docs/exactly-once.md)")
}

// progressFlags say where the relay keeps its progress in Kafka: run
// writes it, status reads it.
func progressFlags(fs *flag.FlagSet, o *options) {
	c := &o.relay
	fs.StringVar(&c.Progress.Topic, "progress-topic", c.Progress.Topic, "compacted Kafka topic where the relay keeps how far Kafka holds every event (one record per slot and cluster); created when missing")
}

// publishFlags shape and route records, for every command that publishes
// outbox rows (run, reconcile --republish).
func publishFlags(fs *flag.FlagSet, o *options) {
	topicFlag(fs, o)
	c := &o.relay
	fs.StringVar(&c.OnPermanentError, "on-permanent-error", c.OnPermanentError, "what to do with an event Kafka will never accept: quarantine (keep it in the quarantine table and go on) or halt")
}

// existingRowsFlag is what a slot made over rows no record covers does
// with them: run and migrate both make slots.
func existingRowsFlag(fs *flag.FlagSet, o *options, run bool) {
	usage := "when a slot must be made that no record in PostgreSQL covers, while the outbox table holds rows (a first start over rows written before the relay ran, or a slot lost with its history): refuse (stop and say so), pending (make the slot with its snapshot, republish every row Kafka lacks, then stream; needs SELECT on the table), or published (make the slot and publish nothing from before it: any event Kafka lacks is lost); see docs/slot-trouble.md"
	if !run {
		usage = "when the slot is missing and a record in PostgreSQL says it existed, or the outbox table holds rows no record covers: refuse (make everything but the slot, exit 1 and say why; the relay then decides), or published (make the slot and publish nothing from before it: any event Kafka lacks is lost). pending is run's alone; see docs/slot-trouble.md"
	}
	fs.StringVar(&o.relay.ExistingRows, "existing-rows", o.relay.ExistingRows, usage)
}

func migrateFlags(fs *flag.FlagSet, o *options) {
	existingRowsFlag(fs, o, false)
	fs.BoolVar(&o.printSQL, "print-sql", false, "print the SQL and exit, for teams that run their own migration tool: the tables, publication and slot; with --skip-slot without the slot, with --slot-only the slot alone")
	fs.BoolVar(&o.skipSlot, "skip-slot", false, "do not create the replication slot (create it later with the relay's role)")
	fs.BoolVar(&o.slotOnly, "slot-only", false, "only create the replication slot (run as the relay's REPLICATION role)")
}

func listFlags(fs *flag.FlagSet, o *options) {
	fs.BoolVar(&o.asJSON, "json", false, "print JSON instead of a table")
	fs.BoolVar(&o.listReplayed, "replayed", false, "also list the events replay delivered, with when and to which topic")
}

// topicFlag routes records: run, reconcile --republish and quarantine
// replay must route alike, or a replay lands where no consumer reads.
func topicFlag(fs *flag.FlagSet, o *options) {
	fs.StringVar(&o.kafka.TopicTemplate, "topic", o.kafka.TopicTemplate, "topic name or template with {aggregate_type} and {event_type}; quarantine replay needs the one run uses")
}

func replayFlags(fs *flag.FlagSet, o *options) {
	fs.BoolVar(&o.replayAll, "all", false, "replay every quarantined event not replayed yet")
	fs.DurationVar(&o.replayTimeout, "replay-timeout", o.replayTimeout, "how long to wait for Kafka's acknowledgements")
}

func logFlags(fs *flag.FlagSet, o *options) {
	fs.StringVar(&o.logLevel, "log-level", o.logLevel, "log level: debug, info, warn, error")
}

// parse reads flags, then fills every flag not given on the command line
// from the environment, then from the --config file: flags win over env, and
// env wins over the file. Flags may come before, between or after the
// positional arguments, which it returns; "--" ends the flags.
func parse(fs *flag.FlagSet, o *options, args []string) ([]string, error) {
	positional, err := parseInterleaved(fs, args)
	if err != nil {
		return nil, err
	}
	explicit := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })

	fromEnv := map[string]bool{}
	fs.VisitAll(func(f *flag.Flag) {
		if explicit[f.Name] || err != nil {
			return
		}
		if v, ok := os.LookupEnv(envName(f.Name)); ok {
			if serr := fs.Set(f.Name, v); serr != nil {
				err = fmt.Errorf("environment variable %s: %q is not %s", envName(f.Name), v, wantedFormat(f))
			}
			fromEnv[f.Name] = true
		}
	})
	if err != nil {
		return nil, err
	}
	warnUnknownEnv(fs.Output())
	if o.configFile != "" {
		if err := applyConfigFile(fs, o.configFile, func(name string) bool {
			return explicit[name] || fromEnv[name] || name == "config"
		}); err != nil {
			return nil, err
		}
	}
	if o.dryRun && !explicit["dry-run"] {
		// A relay under systemd that a stray setting left printing
		// instead of publishing would hold every event back.
		where := "config file " + o.configFile
		if fromEnv["dry-run"] {
			where = "environment variable " + envName("dry-run")
		}
		return nil, fmt.Errorf("--dry-run is set by %s: it is taken only from the command line, so that no stray setting leaves a relay printing instead of publishing; remove it there and pass --dry-run by hand", where)
	}
	return positional, o.finish()
}

// warnUnknownEnv warns about OUTBOX_RELAY_ variables that set nothing,
// such as a misspelt flag name: the same typo as a config file key is
// refused. Only a warning, since the environment may hold variables meant
// for other tools.
func warnUnknownEnv(w io.Writer) {
	known := map[string]bool{envName("kafka-sasl-password"): true}
	for name := range knownFlagNames() {
		known[envName(name)] = true
	}
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "OUTBOX_RELAY_") && !known[name] {
			fmt.Fprintf(w, "outbox-relay: warning: environment variable %s is not a flag of any command and sets nothing (flags map to OUTBOX_RELAY_<FLAG NAME>, e.g. OUTBOX_RELAY_KAFKA_BROKERS)\n", name)
		}
	}
}

// parseInterleaved is fs.Parse that goes on past positional arguments.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return positional, nil
		}
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(positional, rest...), nil
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
}

// listFlagNames are the flags whose value may be a YAML list.
var listFlagNames = map[string]bool{"kafka-brokers": true, "header-columns": true}

// applyConfigFile sets the flags of fs from a flat YAML map of flag names to
// values, skipping the flags skip says are already set. Keys that are flags
// of another command are ignored, so one file serves every command.
func applyConfigFile(fs *flag.FlagSet, path string, skip func(name string) bool) error {
	values, err := readConfigFile(path)
	if err != nil {
		return err
	}
	known := knownFlagNames()
	for _, kv := range values {
		if !known[kv.key] {
			return fmt.Errorf("config file %s: unknown key %q (keys are flag names, e.g. pg-dsn)", path, kv.key)
		}
		f := fs.Lookup(kv.key)
		if f == nil || skip(kv.key) {
			continue
		}
		value, err := kv.text(listFlagNames[kv.key])
		if err == nil {
			if serr := fs.Set(kv.key, value); serr != nil {
				err = fmt.Errorf("%q is not %s", value, wantedFormat(f))
			}
		}
		if err != nil {
			return fmt.Errorf("config file %s: key %s: %w", path, kv.key, err)
		}
	}
	return nil
}

// knownFlagNames are the flags of every command.
func knownFlagNames() map[string]bool {
	known := map[string]bool{}
	for _, command := range allCommands {
		newFlagSet(command, &options{}, io.Discard).VisitAll(func(f *flag.Flag) { known[f.Name] = true })
	}
	return known
}

// wantedFormat says what a flag's value must look like.
func wantedFormat(f *flag.Flag) string {
	getter, ok := f.Value.(flag.Getter)
	if !ok {
		return "a valid value"
	}
	switch getter.Get().(type) {
	case bool:
		return "a boolean: use true or false"
	case time.Duration:
		return "a duration: a number with a unit, e.g. 500ms, 90s, 15m or 168h (units ms, s, m, h; no d)"
	case int, int64:
		return "a whole number"
	}
	return "a valid value"
}

// configValue is one key of the config file with its YAML node.
type configValue struct {
	key  string
	node *yaml.Node
}

// text is the value as a flag would take it: a scalar, or for a list flag
// a list of scalars joined with commas; ${VAR} expanded.
func (v configValue) text(list bool) (string, error) {
	switch v.node.Kind {
	case yaml.ScalarNode:
		return expandEnv(v.node.Value)
	case yaml.SequenceNode:
		if !list {
			return "", errors.New("a list is not allowed here; give one value")
		}
		parts := make([]string, len(v.node.Content))
		for i, item := range v.node.Content {
			if item.Kind != yaml.ScalarNode {
				return "", fmt.Errorf("item %d of the list is not a single value; want host:port", i+1)
			}
			s, err := expandEnv(item.Value)
			if err != nil {
				return "", err
			}
			parts[i] = s
		}
		return strings.Join(parts, ","), nil
	case yaml.MappingNode:
		if list {
			return "", errors.New("a mapping is not allowed here; want a list, or one comma-separated string")
		}
		return "", errors.New("a mapping is not allowed here; give one value")
	}
	return "", errors.New("unsupported YAML value (anchors and aliases are not supported); give one value")
}

// readConfigFile reads a flat YAML map of flag names to values, in file
// order. Null values are left out: they set nothing.
func readConfigFile(path string) ([]configValue, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config file: %w", err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	if len(doc.Content) == 0 {
		return nil, nil
	}
	top := doc.Content[0]
	if top.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("config file %s: want a map of flag names to values (e.g. pg-dsn: postgres://relay@db/app)", path)
	}
	out := make([]configValue, 0, len(top.Content)/2)
	lineOf := map[string]int{}
	for i := 0; i+1 < len(top.Content); i += 2 {
		key, value := top.Content[i], top.Content[i+1]
		if key.Kind != yaml.ScalarNode {
			return nil, fmt.Errorf("config file %s: line %d: keys are flag names, e.g. pg-dsn", path, key.Line)
		}
		// yaml.v3 refuses a repeated key only when decoding into a map;
		// reading nodes, the last one would silently win.
		if first, ok := lineOf[key.Value]; ok {
			return nil, fmt.Errorf("config file %s: line %d: key %s is already set on line %d; keep one", path, key.Line, key.Value, first)
		}
		lineOf[key.Value] = key.Line
		if value.Kind == yaml.ScalarNode && value.Tag == "!!null" {
			continue
		}
		out = append(out, configValue{key: key.Value, node: value})
	}
	return out, nil
}

// expandEnv replaces ${VAR} by the environment variable VAR and $$ by $.
// Any other $ stays as it is, so a password such as pa$word1 is kept whole.
// An unset VAR is an error: an empty secret would fail later and less
// clearly.
func expandEnv(s string) (string, error) {
	if !strings.Contains(s, "$") {
		return s, nil
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 == len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '{':
			end := strings.IndexByte(s[i+2:], '}')
			if end < 0 {
				return "", errors.New("unclosed ${: write ${VAR}, or $$ for a literal $")
			}
			name := s[i+2 : i+2+end]
			v, ok := os.LookupEnv(name)
			if !ok {
				return "", fmt.Errorf("environment variable %s (from ${%s}) is not set; set it, or write $$ for a literal $", name, name)
			}
			b.WriteString(v)
			i += 2 + end
		default:
			b.WriteByte('$')
		}
	}
	return b.String(), nil
}

// finish derives what the flags imply: broker list and secrets.
func (o *options) finish() error {
	o.kafka.Brokers = nil
	for _, b := range strings.Split(o.brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			o.kafka.Brokers = append(o.kafka.Brokers, b)
		}
	}
	if v, ok := os.LookupEnv(envName("kafka-sasl-password")); ok {
		o.saslPassword = v
	}
	if o.saslPasswordFile != "" {
		raw, err := os.ReadFile(o.saslPasswordFile)
		if err != nil {
			return fmt.Errorf("--kafka-sasl-password-file: %w", err)
		}
		o.saslPassword = strings.TrimRight(string(raw), "\r\n")
	}
	o.kafka.Security.SASLPassword = o.saslPassword
	l, err := layout.New(o.outboxLayout, o.columns, o.headerColumns)
	if err != nil {
		return err
	}
	if err := l.SetRecordFormat(o.recordFormat, o.cloudEventsSource); err != nil {
		return err
	}
	if err := l.SetContentType(o.contentType); err != nil {
		return err
	}
	c := &o.relay
	c.Replication.Layout = l
	if c.StatusInterval <= 0 {
		return errors.New("--status-interval must be positive")
	}
	if c.Replication.DeadAfter < minDeadAfter {
		return fmt.Errorf("--pg-timeout %s is too short: at least %s, so that a healthy server's answer to a ping is never taken for a dead connection", c.Replication.DeadAfter, minDeadAfter)
	}
	if c.Replication.DeadAfter > maxDeadAfter {
		return fmt.Errorf("--pg-timeout %s is too long: at most %s; a dead connection would go unnoticed that long while events wait (PostgreSQL's own wal_receiver_timeout is 60s)", c.Replication.DeadAfter, maxDeadAfter)
	}
	if c.ShutdownTimeout < 0 {
		return errors.New("--shutdown-timeout must not be negative")
	}
	return nil
}

// kafkaConfig is the Kafka configuration every path that publishes
// uses: each event topic's keys mapped by the partition count recorded in
// the registry beside the outbox table (docs/partitions.md).
func (o *options) kafkaConfig(log zerolog.Logger) publisher.Config {
	if o.partitions == nil {
		// A --table that does not parse is refused by every command before
		// it publishes, with the flag named.
		if registry, err := store.NewPartitions(o.relay.Replication.Config); err == nil {
			o.partitions = publisher.NewPartitions(registry, log)
		}
	}
	if o.throttle == nil {
		o.throttle = publisher.NewThrottle(log)
	}
	k := o.kafka
	k.Partitions = o.partitions
	k.Throttle = o.throttle
	return k
}

// observeKafka has the partition gauges and the throttle counter of m
// follow what the sinks learn.
func (o *options) observeKafka(m *pipeline.Metrics) {
	if o.partitions != nil {
		o.partitions.Observe(m.SetTopicPartitions)
		o.partitions.ObserveRecordedOverRecords(func(topic string) { m.TopicPartitionsRecordedOverRecords.WithLabelValues(topic).Inc() })
	}
	if o.throttle != nil {
		o.throttle.Observe(func(d time.Duration) { m.KafkaThrottle.Add(d.Seconds()) })
	}
}

// minDeadAfter is the shortest --pg-timeout: a reply to a ping crosses a
// busy server and link in well under a second, three pings fit inside it.
const minDeadAfter = 3 * time.Second

// maxDeadAfter is the longest: beyond it the bound stops bounding
// anything an operator waits for, and the kernel refuses TCP_USER_TIMEOUT
// values past about 24 days.
const maxDeadAfter = time.Hour

// relayConfig is the relay's configuration, with the Kafka sinks of the
// flags.
func (o *options) relayConfig(log zerolog.Logger) relay.Config {
	c := o.relay
	c.Sinks = publisher.NewKafka(o.kafkaConfig(log), log)
	if (c.OnSlotLost == relay.SlotLostRecover || c.ExistingRows == relay.ExistingRowsPending) && c.Replication.ReadsTable() {
		c.Recoverer = newTableRecoverer(o, log)
	}
	return c
}

// requireBrokers refuses a command that publishes without --kafka-brokers.
func (o *options) requireBrokers() error {
	if len(o.kafka.Brokers) == 0 {
		return errors.New("--kafka-brokers is required: a comma-separated list of host:port")
	}
	return o.kafka.Validate()
}
