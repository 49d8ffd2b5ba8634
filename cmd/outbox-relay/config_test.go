package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/layout"
)

// Flags win over the environment, which wins over the --config file.
func TestConfigPrecedence(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "relay.yaml")
	os.WriteFile(file, []byte(`
pg-dsn: postgres://file@db/app
kafka-brokers: [k1:9092, k2:9092]
slot: from_file
topic: from.file
table: ${OUTBOX_TEST_SCHEMA}.events
`), 0o600)
	t.Setenv("OUTBOX_TEST_SCHEMA", "sales")
	t.Setenv("OUTBOX_RELAY_SLOT", "from_env")
	t.Setenv("OUTBOX_RELAY_TOPIC", "from.env")

	o := &options{}
	fs := newFlagSet("run", o, &bytes.Buffer{})
	if _, err := parse(fs, o, []string{"--config", file, "--topic", "from.flag"}); err != nil {
		t.Fatal(err)
	}
	c := o.relay
	if o.kafka.TopicTemplate != "from.flag" {
		t.Errorf("topic %q: the flag must win", o.kafka.TopicTemplate)
	}
	if c.Replication.Slot != "from_env" {
		t.Errorf("slot %q: the environment must win over the file", c.Replication.Slot)
	}
	if c.Replication.DSN != "postgres://file@db/app" || c.Replication.Table != "sales.events" {
		t.Errorf("file values not applied: dsn %q table %q", c.Replication.DSN, c.Replication.Table)
	}
	if strings.Join(o.kafka.Brokers, ",") != "k1:9092,k2:9092" {
		t.Errorf("brokers %v", o.kafka.Brokers)
	}
	if o.kafka.Compression != "lz4" || o.adminAddr != "127.0.0.1:9797" {
		t.Errorf("defaults lost: compression %q admin %q", o.kafka.Compression, o.adminAddr)
	}
}

func TestConfigFileUnknownKeyIsNamed(t *testing.T) {
	file := filepath.Join(t.TempDir(), "relay.yaml")
	os.WriteFile(file, []byte("pg_dsn: x\n"), 0o600)
	o := &options{}
	fs := newFlagSet("run", o, &bytes.Buffer{})
	_, err := parse(fs, o, []string{"--config", file})
	if err == nil || !strings.Contains(err.Error(), `unknown key "pg_dsn"`) {
		t.Fatalf("err = %v", err)
	}
}

func TestSASLPasswordFromEnvAndFile(t *testing.T) {
	t.Setenv("OUTBOX_RELAY_KAFKA_SASL_PASSWORD", "from-env")
	o := &options{}
	if _, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, nil); err != nil {
		t.Fatal(err)
	}
	if o.kafka.Security.SASLPassword != "from-env" {
		t.Fatalf("password %q", o.kafka.Security.SASLPassword)
	}
	file := filepath.Join(t.TempDir(), "pw")
	os.WriteFile(file, []byte("from-file\n"), 0o600)
	o = &options{}
	if _, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, []string{"--kafka-sasl-password-file", file}); err != nil {
		t.Fatal(err)
	}
	if o.kafka.Security.SASLPassword != "from-file" {
		t.Fatalf("password %q", o.kafka.Security.SASLPassword)
	}
}

// Configuration errors exit 2 with one line naming the flag, and never
// print the DSN's password.
func TestConfigErrorsExitTwoWithoutSecrets(t *testing.T) {
	for _, args := range [][]string{
		{"run", "--pg-dsn", "postgres://u:hunter2@h/db", "--kafka-brokers", "k:1", "--on-permanent-error", "skip"},
		{"run", "--pg-dsn", "postgres://u:hunter2@h/db"},
		{"run", "--pg-dsn", "postgres://u:hunter2@h/db", "--kafka-brokers", "k:1", "--table", "a.b.c"},
		{"run", "--pg-dsn", "postgres://u:hunter2@h/db", "--kafka-brokers", "k:1", "--log-level", "loud"},
		{"run", "--pg-dsn", "postgres://u:hunter2@h/db", "--kafka-brokers", "k:1", "--kafka-linger", "5s"},
		{"run", "--pg-dsn", "postgres://u:hunter2@h/db", "--kafka-brokers", "k:1", "--read-tick", "1s"},
		{"frobnicate"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), args, &stdout, &stderr)
		out := stderr.String()
		if code != exitUsage || strings.Contains(out, "hunter2") || strings.Count(strings.TrimSpace(out), "\n") > 20 {
			t.Errorf("%v: exit %d, stderr %q", args, code, out)
		}
	}
}

func TestVersion(t *testing.T) {
	var stdout bytes.Buffer
	if code := run(context.Background(), []string{"version"}, &stdout, &bytes.Buffer{}); code != 0 || !strings.HasPrefix(stdout.String(), "outbox-relay ") {
		t.Fatalf("version: %d %q", code, stdout.String())
	}
}

// Issue 24.11: a config file with pg-dsn twice silently used the last one.
func TestConfigFileRepeatedKeyIsRefused(t *testing.T) {
	file := filepath.Join(t.TempDir(), "relay.yaml")
	os.WriteFile(file, []byte("pg-dsn: postgres://a/db\nkafka-brokers: k:1\npg-dsn: postgres://b/db\n"), 0o600)
	o := &options{}
	_, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, []string{"--config", file})
	if err == nil || !strings.Contains(err.Error(), "line 3: key pg-dsn is already set on line 1") {
		t.Fatalf("err = %v", err)
	}
}

// Issue 24.11: OUTBOX_RELAY_KAFKA_BROKERZ=x was ignored without a word,
// while the same typo as a file key is refused.
func TestUnknownEnvironmentVariableIsWarnedAbout(t *testing.T) {
	t.Setenv("OUTBOX_RELAY_KAFKA_BROKERZ", "x")
	t.Setenv("OUTBOX_RELAY_KAFKA_BROKERS", "k:1")
	t.Setenv("OUTBOX_RELAY_KAFKA_SASL_PASSWORD", "pw")
	var stderr bytes.Buffer
	o := &options{}
	if _, err := parse(newFlagSet("migrate", o, &stderr), o, nil); err != nil {
		t.Fatal(err)
	}
	out := stderr.String()
	if !strings.Contains(out, "OUTBOX_RELAY_KAFKA_BROKERZ is not a flag") {
		t.Errorf("no warning about the misspelt variable:\n%s", out)
	}
	// A flag of another command, and the password, are not typos.
	if strings.Contains(out, "OUTBOX_RELAY_KAFKA_BROKERS ") || strings.Contains(out, "SASL_PASSWORD") {
		t.Errorf("warned about a known variable:\n%s", out)
	}
}

// The layout flags read well in YAML: one key per column, header columns
// as a list; each command that reads the table takes them, and a bad value
// is refused at start-up naming the flag.
func TestLayoutFlags(t *testing.T) {
	file := filepath.Join(t.TempDir(), "relay.yaml")
	os.WriteFile(file, []byte(`
pg-dsn: postgres://file@db/app
outbox-layout: debezium
column-aggregate-id: aggregate_key
header-columns: [tenant, "type:eventType"]
`), 0o600)
	for _, command := range []string{"run", "migrate", "status", "reconcile", "quarantine list", "quarantine replay"} {
		o := &options{}
		if _, err := parse(newFlagSet(command, o, &bytes.Buffer{}), o, []string{"--config", file}); err != nil {
			t.Fatalf("%s: %v", command, err)
		}
		l := o.relay.Replication.OutboxLayout()
		if l.Name() != "debezium" || l.Column(layout.AggregateID) != "aggregate_key" || l.Column(layout.EventID) != "id" ||
			strings.Join(l.HeaderNames(), ",") != "tenant,eventType" || l.HeaderColumns[1].Column != "type" {
			t.Fatalf("%s: layout %+v", command, l)
		}
	}
	for _, tc := range []struct{ args, want string }{
		{"--outbox-layout debezum", `--outbox-layout "debezum"`},
		{"--header-columns tenant", "--header-columns needs --outbox-layout debezium"},
		{"--outbox-layout debezium --header-columns tenant,x:tenant", `header "tenant" appears twice`},
		{"--outbox-layout debezium --header-columns x:id", `header "id" appears twice, or is the event id's header`},
	} {
		var stderr bytes.Buffer
		code := run(context.Background(), append([]string{"migrate", "--pg-dsn", "postgres://x@db/app"}, strings.Fields(tc.args)...), &bytes.Buffer{}, &stderr)
		if code != exitUsage || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%s: exit %d, want 2 with %q: %s", tc.args, code, tc.want, stderr.String())
		}
	}
}

// --record-format, --cloudevents-source and --content-type come from flags, the
// environment or the config file like every flag, reach the layout of
// every command that builds or reads records, and a CloudEvents format
// without a valid source is refused at start-up (exit 2) naming the flag.
func TestRecordFormatFlags(t *testing.T) {
	file := filepath.Join(t.TempDir(), "relay.yaml")
	os.WriteFile(file, []byte(`
pg-dsn: postgres://file@db/app
record-format: cloudevents-structured
content-type: application/x-protobuf
`), 0o600)
	t.Setenv(envName("cloudevents-source"), "https://example.com/billing")
	for _, command := range []string{"run", "migrate", "status", "reconcile", "quarantine list", "quarantine replay"} {
		o := &options{}
		if _, err := parse(newFlagSet(command, o, &bytes.Buffer{}), o, []string{"--config", file}); err != nil {
			t.Fatalf("%s: %v", command, err)
		}
		l := o.relay.Replication.OutboxLayout()
		if l.RecordFormat() != layout.FormatCloudEventsStructured || l.CloudEventsSource != "https://example.com/billing" || l.Name() != "relay" ||
			l.ContentType != "application/x-protobuf" {
			t.Fatalf("%s: layout %+v", command, l)
		}
	}
	os.Unsetenv(envName("cloudevents-source"))
	for _, tc := range []struct{ args, want string }{
		{"--record-format cloudevents", "--cloudevents-source \"\" with --record-format cloudevents: the CloudEvents formats need a source"},
		{"--record-format cloudevents-structured --cloudevents-source http://a\tb", "is not allowed in a URI reference"},
		{"--record-format json", `--record-format "json": use relay`},
		{"--cloudevents-source /billing", "--record-format is relay"},
		{"--content-type protobuf", `--content-type "protobuf": not a media type`},
	} {
		var stderr bytes.Buffer
		code := run(context.Background(), append([]string{"run", "--pg-dsn", "postgres://x@db/app", "--kafka-brokers", "k:1"}, strings.Split(tc.args, " ")...), &bytes.Buffer{}, &stderr)
		if code != exitUsage || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%s: exit %d, want 2 with %q: %s", tc.args, code, tc.want, stderr.String())
		}
	}
}

// --dry-run set in a config file or the environment would leave a relay
// under systemd printing instead of publishing, every event held back, on
// a stray line: it is taken only from the command line.
func TestDryRunOnlyFromTheCommandLine(t *testing.T) {
	file := filepath.Join(t.TempDir(), "relay.yaml")
	if err := os.WriteFile(file, []byte("dry-run: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	o := &options{}
	if _, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, []string{"--config", file}); err == nil || !strings.Contains(err.Error(), "config file "+file) {
		t.Errorf("dry-run from the config file: %v, want refused naming the file", err)
	}
	o = &options{}
	if _, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, []string{"--config", file, "--dry-run"}); err != nil || !o.dryRun {
		t.Errorf("dry-run on the command line: %v (set: %t)", err, o.dryRun)
	}
	t.Setenv("OUTBOX_RELAY_DRY_RUN", "true")
	o = &options{}
	if _, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, nil); err == nil || !strings.Contains(err.Error(), "OUTBOX_RELAY_DRY_RUN") {
		t.Errorf("dry-run from the environment: %v, want refused naming the variable", err)
	}
	t.Setenv("OUTBOX_RELAY_DRY_RUN", "false")
	o = &options{}
	if _, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, nil); err != nil {
		t.Errorf("dry-run false from the environment: %v", err)
	}
}

// --pg-timeout is refused outside 3s..1h by every command, before any
// connection: below, a healthy server's answer to a ping could be taken for
// a dead connection; above, the kernel refuses TCP_USER_TIMEOUT at some
// point and every connection would fail in a retry loop.
func TestPGTimeoutBounds(t *testing.T) {
	for _, value := range []string{"0s", "-1s", "2999ms", "1000h", "61m"} {
		for _, command := range [][]string{{"run", "--kafka-brokers", "k:1"}, {"migrate"}, {"status", "--kafka-brokers", "k:1"}, {"run", "--source", "poll", "--kafka-brokers", "k:1"}} {
			args := append(append([]string{}, command...), "--pg-dsn", "postgres://u@h/db", "--pg-timeout", value)
			var stdout, stderr bytes.Buffer
			code := run(context.Background(), args, &stdout, &stderr)
			if code != exitUsage || !strings.Contains(stderr.String(), "--pg-timeout") {
				t.Errorf("%v: exit %d, stderr %q; want 2 naming --pg-timeout", args, code, stderr.String())
			}
		}
	}
}
