package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/outbox-relay/outbox-relay/relay"
)

// options is everything a command can be told, with the relay's defaults.
type options struct {
	relay      relay.Config
	brokers    string
	adminAddr  string
	logLevel   string
	configFile string

	saslPasswordFile string
	saslPassword     string
}

// envName is the environment variable that sets a flag.
func envName(flagName string) string {
	return "OUTBOX_RELAY_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// newFlagSet declares the flags shared by the commands. Every flag can also
// come from OUTBOX_RELAY_<NAME> and from the YAML file given by --config.
func newFlagSet(name string, o *options, stderr io.Writer) *flag.FlagSet {
	*o = options{relay: relay.DefaultConfig(), adminAddr: "127.0.0.1:9797", logLevel: "info"}
	c := &o.relay
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.configFile, "config", "", "YAML file of flag values (keys are flag names); flags and env win over it")
	fs.StringVar(&c.Replication.DSN, "pg-dsn", "", "PostgreSQL connection string, libpq URL or key=value (required)")
	fs.StringVar(&o.brokers, "kafka-brokers", "", "comma-separated Kafka bootstrap brokers, host:port (required)")
	fs.StringVar(&c.Replication.Table, "table", c.Replication.Table, "schema-qualified outbox table")
	fs.StringVar(&c.Replication.Publication, "publication", c.Replication.Publication, "publication that carries the outbox table's inserts")
	fs.StringVar(&c.Replication.Slot, "slot", c.Replication.Slot, "logical replication slot name")
	fs.BoolVar(&c.Replication.SlotFailover, "slot-failover", false, "create the slot as a failover slot (PostgreSQL 17+)")
	fs.BoolVar(&c.RecreateLostSlot, "recreate-lost-slot", false, "drop and recreate a slot the server invalidated; events in the lost WAL are NOT delivered")
	fs.StringVar(&c.Publisher.TopicTemplate, "topic", c.Publisher.TopicTemplate, "topic name or template with {aggregate_type} and {event_type}")
	fs.StringVar(&c.Publisher.Compression, "compression", c.Publisher.Compression, "record compression: none, gzip, snappy, lz4, zstd")
	fs.StringVar(&c.Publisher.KafkaVersion, "kafka-version", c.Publisher.KafkaVersion, "Kafka protocol version to speak (0.11 or newer)")
	fs.IntVar(&c.Publisher.MaxMessageBytes, "kafka-max-message-bytes", c.Publisher.MaxMessageBytes, "largest record and per-partition batch the producer sends; keep at or below the topics' max.message.bytes")
	fs.IntVar(&c.Publisher.RetryMax, "kafka-retry-max", c.Publisher.RetryMax, "producer retries of a retriable error before the relay re-streams from the slot")
	fs.DurationVar(&c.Publisher.RetryBackoffMax, "kafka-retry-backoff-max", c.Publisher.RetryBackoffMax, "cap of the producer's exponential retry backoff")
	fs.DurationVar(&c.Publisher.Linger, "kafka-linger", c.Publisher.Linger, "how long a batch waits for more records when no request is in flight (linger.ms); a few ms cut the broker's CPU at the cost of that much latency")
	fs.BoolVar(&c.Publisher.Security.TLS, "kafka-tls", false, "connect to Kafka over TLS (certificate and host name verified)")
	fs.StringVar(&c.Publisher.Security.CA, "kafka-tls-ca", "", "PEM file of the CA that signed the brokers' certificates (default: system roots)")
	fs.StringVar(&c.Publisher.Security.Cert, "kafka-tls-cert", "", "client certificate PEM file, for mutual TLS")
	fs.StringVar(&c.Publisher.Security.Key, "kafka-tls-key", "", "client key PEM file, for mutual TLS")
	fs.StringVar(&c.Publisher.Security.ServerName, "kafka-tls-server-name", "", "name to verify in the brokers' certificates (default: the broker host)")
	fs.BoolVar(&c.Publisher.Security.InsecureSkipVerify, "kafka-tls-insecure-skip-verify", false, "DANGEROUS: accept any broker certificate")
	fs.StringVar(&c.Publisher.Security.SASLMechanism, "kafka-sasl-mechanism", "", "SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
	fs.StringVar(&c.Publisher.Security.SASLUser, "kafka-sasl-user", "", "SASL user name")
	fs.StringVar(&o.saslPasswordFile, "kafka-sasl-password-file", "", "file holding the SASL password (or set OUTBOX_RELAY_KAFKA_SASL_PASSWORD)")
	fs.IntVar(&c.MaxInFlightEvents, "max-in-flight-events", c.MaxInFlightEvents, "events sent and not yet acknowledged before reading pauses")
	fs.Int64Var(&c.MaxInFlightBytes, "max-in-flight-bytes", c.MaxInFlightBytes, "record bytes sent and not yet acknowledged before reading pauses")
	fs.DurationVar(&c.StatusInterval, "status-interval", c.StatusInterval, "how often a moved confirmed position is reported to PostgreSQL")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "how long SIGTERM waits for in-flight acks")
	fs.StringVar(&c.OnPermanentError, "on-permanent-error", c.OnPermanentError, "what to do with an event Kafka will never accept: quarantine (keep it in the quarantine table and go on) or halt")
	fs.StringVar(&c.QuarantineTable, "quarantine-table", "", "schema-qualified quarantine table (default: outbox_quarantine in the outbox table's schema)")
	fs.DurationVar(&c.Retention.After, "retention", 0, "delete published outbox rows older than this, e.g. 168h (0: never)")
	fs.DurationVar(&c.Retention.Margin, "retention-margin", c.Retention.Margin, "keep rows this much younger than the confirmed position's commit time; longer than your longest transaction")
	fs.DurationVar(&c.Retention.Interval, "retention-interval", c.Retention.Interval, "how often cleanup runs")
	fs.IntVar(&c.Retention.Batch, "retention-batch", c.Retention.Batch, "rows deleted per transaction")
	fs.BoolVar(&c.Retention.DryRun, "retention-dry-run", false, "log what cleanup would delete, delete nothing")
	fs.StringVar(&c.Progress.Topic, "progress-topic", c.Progress.Topic, "compacted Kafka topic where the relay keeps how far Kafka holds every event (one record per slot and cluster); created when missing")
	fs.BoolVar(&c.Progress.Reset, "reset-progress", false, "ignore the stored progress record once, at the first start of this process, and start from the slot (after restoring a backup)")
	fs.StringVar(&o.adminAddr, "admin-addr", o.adminAddr, "address of the admin endpoint (/healthz, /readyz, /slot, /metrics); empty disables it")
	fs.StringVar(&o.logLevel, "log-level", o.logLevel, "log level: debug, info, warn, error")
	return fs
}

// parse reads flags, then fills every flag not given on the command line
// from the environment, then from the --config file: flags win over env, and
// env wins over the file.
func parse(fs *flag.FlagSet, o *options, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	explicit := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })

	fromEnv := map[string]bool{}
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if explicit[f.Name] || err != nil {
			return
		}
		if v, ok := os.LookupEnv(envName(f.Name)); ok {
			if serr := fs.Set(f.Name, v); serr != nil {
				err = fmt.Errorf("environment variable %s: %w", envName(f.Name), serr)
			}
			fromEnv[f.Name] = true
		}
	})
	if err != nil {
		return err
	}
	if o.configFile != "" {
		values, ferr := readConfigFile(o.configFile)
		if ferr != nil {
			return ferr
		}
		for key, v := range values {
			if fs.Lookup(key) == nil {
				return fmt.Errorf("config file %s: unknown key %q (keys are flag names, e.g. pg-dsn)", o.configFile, key)
			}
			if explicit[key] || fromEnv[key] || key == "config" {
				continue
			}
			if serr := fs.Set(key, v); serr != nil {
				return fmt.Errorf("config file %s: key %s: %w", o.configFile, key, serr)
			}
		}
	}
	return o.finish()
}

// readConfigFile reads a flat YAML map of flag names to values, expanding
// ${VAR} references so secrets can stay in the environment.
func readConfigFile(path string) (map[string]string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config file: %w", err)
	}
	var doc map[string]any
	if err := yaml.Unmarshal([]byte(os.ExpandEnv(string(raw))), &doc); err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	out := make(map[string]string, len(doc))
	for k, v := range doc {
		switch v := v.(type) {
		case []any:
			parts := make([]string, len(v))
			for i, p := range v {
				parts[i] = fmt.Sprint(p)
			}
			out[k] = strings.Join(parts, ",")
		case nil:
		default:
			out[k] = fmt.Sprint(v)
		}
	}
	return out, nil
}

// finish derives what the flags imply: broker list and secrets.
func (o *options) finish() error {
	c := &o.relay
	c.Publisher.Brokers = nil
	for _, b := range strings.Split(o.brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			c.Publisher.Brokers = append(c.Publisher.Brokers, b)
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
	c.Publisher.Security.SASLPassword = o.saslPassword
	if c.StatusInterval <= 0 {
		return errors.New("--status-interval must be positive")
	}
	if c.ShutdownTimeout < 0 {
		return errors.New("--shutdown-timeout must not be negative")
	}
	return nil
}
