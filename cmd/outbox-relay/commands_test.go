package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/sink"
)

// deadDSN points at a port nobody listens on, with a password that must
// never be printed.
func deadDSN(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return fmt.Sprintf("postgres://relay:hunter2@127.0.0.1:%d/app?connect_timeout=5", port)
}

func runCaptured(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = run(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// Every command exits 1 when PostgreSQL cannot be reached (the flags were
// fine) and 2 for bad flags, before touching anything.
func TestExitCodeContract(t *testing.T) {
	dsn := deadDSN(t)
	unreachable := [][]string{
		{"migrate", "--pg-dsn", dsn},
		{"status", "--pg-dsn", dsn},
		{"quarantine", "list", "--pg-dsn", dsn},
		{"quarantine", "replay", "--all", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1"},
	}
	for _, args := range unreachable {
		code, _, stderr := runCaptured(args...)
		if code != exitFailure {
			t.Errorf("%v with PostgreSQL unreachable: exit %d, want %d\n%s", args[:2], code, exitFailure, stderr)
		}
		if strings.Contains(stderr, "hunter2") {
			t.Errorf("%v printed the password: %s", args[:2], stderr)
		}
	}
	badFlags := [][]string{
		{"migrate", "--pg-dsn", dsn, "--slot", "Bad-Slot"},
		{"migrate", "--pg-dsn", dsn, "--no-such-flag"},
		{"migrate", "--pg-dsn", dsn, "extra-argument"},
		{"status"},
		{"status", "--pg-dsn", dsn, "--table", "a.b.c"},
		{"quarantine", "list", "--pg-dsn", dsn, "--quarantine-table", "a.b.c"},
		{"quarantine", "replay", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1"},
		{"quarantine", "replay", "--all", "--pg-dsn", dsn},
		{"quarantine", "replay", "--all", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1", "--compression", "brotli"},
		{"quarantine", "frobnicate"},
		{"run", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1", "extra-argument"},
		{"run", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1", "--status-interval", "0s"},
		{"frobnicate"},
	}
	for _, args := range badFlags {
		if code, _, stderr := runCaptured(args...); code != exitUsage || strings.Contains(stderr, "hunter2") {
			t.Errorf("%v: exit %d, want %d\n%s", args, code, exitUsage, stderr)
		}
	}
	for _, args := range [][]string{{"version"}, {"help"}, {"run", "-h"}, {"migrate", "-h"}, {"quarantine", "replay", "-h"}} {
		if code, _, stderr := runCaptured(args...); code != exitOK {
			t.Errorf("%v: exit %d, want 0\n%s", args, code, stderr)
		}
	}
}

// Settings Kafka would refuse in every session stop run at start-up with
// exit 2 and the flag's name, instead of failing each session forever.
func TestRunRefusesBadKafkaSettingsAtStartUp(t *testing.T) {
	password := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(password, []byte("secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := []string{"run", "--pg-dsn", deadDSN(t), "--kafka-brokers", "127.0.0.1:1", "--admin-addr", ""}
	for _, tc := range []struct {
		flags []string
		named string
	}{
		{[]string{"--compression", "brotli"}, "--compression"},
		{[]string{"--topic", "outbox.{aggregate}"}, "--topic"},
		{[]string{"--topic", "bad/topic"}, "--topic"},
		{[]string{"--topic", "bad/{event_type}"}, "--topic"},
		{[]string{"--kafka-version", "banana"}, "--kafka-version"},
		{[]string{"--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-user", "relay"}, "--kafka-sasl-mechanism"},
		{[]string{"--quarantine-table", "a.b.c"}, "--quarantine-table"},
		// Issue 24.7: each of these streamed with less security than asked
		// for (plaintext, unauthenticated, a password in the clear).
		{[]string{"--kafka-tls-ca", "/nonexistent/ca.pem"}, "--kafka-tls-ca is set but --kafka-tls is not"},
		{[]string{"--kafka-tls-cert", "/nonexistent/c.pem", "--kafka-tls-key", "/nonexistent/k.pem"}, "--kafka-tls-cert is set but --kafka-tls is not"},
		{[]string{"--kafka-tls-insecure-skip-verify"}, "--kafka-tls-insecure-skip-verify is set but --kafka-tls is not"},
		{[]string{"--kafka-sasl-user", "relay", "--kafka-sasl-password-file", "/dev/null"}, "--kafka-sasl-mechanism is not"},
		{[]string{"--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-user", "relay", "--kafka-sasl-password-file", password}, "--kafka-sasl-plain-without-tls"},
		// Issue 24.12: these were clamped or taken without a word.
		{[]string{"--kafka-retry-max", "0"}, "--kafka-retry-max 0"},
		{[]string{"--kafka-retry-max", "-1"}, "--kafka-retry-max -1"},
		{[]string{"--kafka-retry-backoff-max", "0s"}, "--kafka-retry-backoff-max 0s"},
		{[]string{"--kafka-retry-backoff-max", "-5s"}, "--kafka-retry-backoff-max -5s"},
		// Issue 24.10: run retried these forever ("missing port in address").
		{[]string{"--kafka-brokers", "not a broker"}, `--kafka-brokers "not a broker"`},
		{[]string{"--kafka-brokers", "http://127.0.0.1:19092"}, `--kafka-brokers "http://127.0.0.1:19092"`},
		{[]string{"--kafka-brokers", "k1:9092,k2"}, `--kafka-brokers "k2"`},
		{[]string{"--kafka-brokers", "k1:99999"}, `--kafka-brokers "k1:99999"`},
		{[]string{"--kafka-brokers", "k1:"}, `--kafka-brokers "k1:"`},
		{[]string{"--delivery", "exactly-twice"}, "--delivery"},
		{[]string{"--delivery", "exactly-once", "--transaction-interval", "0s"}, "--transaction-interval"},
		{[]string{"--delivery", "exactly-once", "--transaction-interval", "1h"}, "--transaction-interval"},
		{[]string{"--delivery", "exactly-once", "--progress-topic", ""}, "--progress-topic"},
	} {
		code, _, stderr := runCaptured(append(base, tc.flags...)...)
		if code != exitUsage || !strings.Contains(stderr, tc.named) {
			t.Errorf("%v: exit %d, want %d naming %s:\n%s", tc.flags, code, exitUsage, tc.named, stderr)
		}
	}
}

// --on-slot-lost recover is refused at start-up, with the reason, wherever
// it could not keep its promise: a source with no table to republish from
// (messages) or no slot to lose (poll), beside --recreate-lost-slot, which
// gives the gap up, or with no progress topic to say where the gap starts.
func TestOnSlotLostRefusesWhatItCannotRecover(t *testing.T) {
	base := []string{"run", "--pg-dsn", deadDSN(t), "--kafka-brokers", "127.0.0.1:1", "--admin-addr", "", "--on-slot-lost", "recover"}
	for _, tc := range []struct {
		flags []string
		named string
	}{
		{[]string{"--source", "messages", "--message-prefix", "outbox"}, "the messages source has none"},
		{[]string{"--source", "poll"}, "--on-slot-lost recover with --source poll: poll mode needs no replication slot"},
		{[]string{"--recreate-lost-slot"}, "--on-slot-lost recover and --recreate-lost-slot contradict each other"},
		{[]string{"--progress-topic", ""}, "--on-slot-lost recover needs --progress-topic"},
		{[]string{"--on-slot-lost", "retry"}, `--on-slot-lost "retry": use stop or recover`},
	} {
		code, _, stderr := runCaptured(append(base, tc.flags...)...)
		if code != exitUsage || !strings.Contains(stderr, tc.named) {
			t.Errorf("%v: exit %d, want %d naming %s:\n%s", tc.flags, code, exitUsage, tc.named, stderr)
		}
	}
}

// --poll-strategy takes lease or snapshot, on run and migrate alike, and
// says so at start-up (exit 2).
func TestPollStrategyIsChecked(t *testing.T) {
	for _, args := range [][]string{
		{"run", "--source", "poll", "--pg-dsn", deadDSN(t), "--kafka-brokers", "127.0.0.1:1", "--admin-addr", "", "--poll-strategy", "pgq"},
		{"migrate", "--source", "poll", "--pg-dsn", deadDSN(t), "--poll-strategy", "pgq"},
	} {
		code, _, stderr := runCaptured(args...)
		if code != exitUsage || !strings.Contains(stderr, `--poll-strategy "pgq": use lease or snapshot`) {
			t.Errorf("%s: exit %d, want %d naming the strategies:\n%s", args[0], code, exitUsage, stderr)
		}
	}
}

// The settings every source shares are checked by one rule each, so both
// sources refuse them the same way: the retention's and the policy for an
// event the sink never accepts.
func TestEverySourceRefusesSharedSettingsAlike(t *testing.T) {
	for _, source := range []string{"wal", "poll"} {
		base := []string{"run", "--source", source, "--pg-dsn", deadDSN(t), "--kafka-brokers", "127.0.0.1:1", "--admin-addr", ""}
		for _, tc := range []struct {
			flags []string
			named string
		}{
			{[]string{"--retention", "-1h"}, "--retention -1h0m0s: must not be negative"},
			{[]string{"--retention", "1h", "--retention-interval", "0s"}, "--retention-interval 0s: must be positive"},
			{[]string{"--retention", "1h", "--retention-batch", "0"}, "--retention-batch 0: must be at least 1"},
			{[]string{"--on-permanent-error", "ignore"}, `--on-permanent-error "ignore": use quarantine or halt`},
		} {
			code, _, stderr := runCaptured(append(base, tc.flags...)...)
			if code != exitUsage || !strings.Contains(stderr, tc.named) {
				t.Errorf("--source %s %v: exit %d, want %d naming %s:\n%s", source, tc.flags, code, exitUsage, tc.named, stderr)
			}
		}
	}
}

// The quarantine table's own flag is named in its errors, not --table.
func TestQuarantineTableErrorNamesItsFlag(t *testing.T) {
	for _, args := range [][]string{
		{"run", "--pg-dsn", deadDSN(t), "--kafka-brokers", "127.0.0.1:1", "--quarantine-table", "a.b.c"},
		{"migrate", "--print-sql", "--quarantine-table", "a.b.c"},
		{"quarantine", "list", "--pg-dsn", deadDSN(t), "--quarantine-table", "a.b.c"},
	} {
		_, _, stderr := runCaptured(args...)
		if !strings.Contains(stderr, `--quarantine-table "a.b.c": want schema.table`) || strings.Contains(stderr, "--table") {
			t.Errorf("%v: %s", args, stderr)
		}
	}
}

// migrate --print-sql validates the names it prints into SQL.
func TestPrintSQLValidatesNames(t *testing.T) {
	code, stdout, stderr := runCaptured("migrate", "--print-sql", "--slot", "x'); select pg_drop_replication_slot('y'); --")
	if code != exitUsage || strings.Contains(stdout, "pg_drop_replication_slot") || !strings.Contains(stderr, "--slot") {
		t.Errorf("exit %d\nstdout %s\nstderr %s", code, stdout, stderr)
	}
	if code, stdout, _ := runCaptured("migrate", "--print-sql"); code != exitOK || !strings.Contains(stdout, "pg_create_logical_replication_slot('outbox_relay'") {
		t.Errorf("plain --print-sql: exit %d\n%s", code, stdout)
	}
}

// Flags may follow positional arguments: `quarantine replay <id> --pg-dsn`
// used to drop everything after the id.
func TestFlagsAfterPositionalArguments(t *testing.T) {
	dsn := deadDSN(t)
	o := &options{}
	fs := newFlagSet("quarantine replay", o, &bytes.Buffer{})
	ids, err := parse(fs, o, []string{"id-1", "--pg-dsn", dsn, "id-2", "--kafka-brokers", "k:1", "--", "--id-3"})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(ids, " ") != "id-1 id-2 --id-3" || o.relay.Replication.DSN != dsn || strings.Join(o.kafka.Brokers, ",") != "k:1" {
		t.Errorf("ids %q dsn %q brokers %v", ids, o.relay.Replication.DSN, o.kafka.Brokers)
	}
	// Through the command: the flags after the id are used, so the replay
	// gets as far as connecting (exit 1), not "--pg-dsn is required" (2).
	code, _, stderr := runCaptured("quarantine", "replay", "6f1c2d3e-4b5a-4c7d-8e9f-0a1b2c3d4e5f", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1")
	if code != exitFailure || strings.Contains(stderr, "required") {
		t.Errorf("exit %d: %s", code, stderr)
	}
}

// Each command's help lists its own flags only.
func TestHelpListsOnlyTheCommandsFlags(t *testing.T) {
	for _, tc := range []struct {
		args       []string
		want, deny []string
	}{
		{[]string{"migrate", "-h"}, []string{"-pg-dsn", "-print-sql", "-slot-only", "-quarantine-table", "-log-level"},
			[]string{"-kafka-brokers", "-topic", "-retention", "-admin-addr", "-max-in-flight-events", "-json"}},
		{[]string{"status", "-h"}, []string{"-pg-dsn", "-slot", "-table", "-config", "-kafka-brokers", "-progress-topic", "-delivery"},
			[]string{"-topic", "-retention", "-admin-addr", "-print-sql", "-log-level", "-reset-progress", "-transaction-interval"}},
		{[]string{"quarantine", "list", "-h"}, []string{"-json", "-quarantine-table"},
			[]string{"-kafka-brokers", "-all", "-retention"}},
		{[]string{"quarantine", "replay", "-h"}, []string{"-all", "-replay-timeout", "-kafka-brokers", "-kafka-tls", "-topic"},
			[]string{"-json", "-retention", "-admin-addr"}},
		{[]string{"run", "-h"}, []string{"-kafka-brokers", "-topic", "-retention", "-admin-addr", "-slot-failover"},
			[]string{"-print-sql", "-json", "-all"}},
	} {
		_, _, help := runCaptured(tc.args...)
		flags := map[string]bool{}
		for _, line := range strings.Split(help, "\n") {
			if f, ok := strings.CutPrefix(line, "  -"); ok {
				flags["-"+strings.Fields(f)[0]] = true
			}
		}
		for _, f := range tc.want {
			if !flags[f] {
				t.Errorf("%v does not list %s", tc.args, f)
			}
		}
		for _, f := range tc.deny {
			if flags[f] {
				t.Errorf("%v lists %s, which does not apply", tc.args, f)
			}
		}
	}
}

// run -h printed the worker id's default twice, "(default host:pid)
// (default "vm:28809")" (issue 30): the usage names the default, the
// process's own host:pid is no default to show.
func TestHelpShowsTheWorkerIDDefaultOnce(t *testing.T) {
	_, _, help := runCaptured("run", "-h")
	i := strings.Index(help, "-poll-worker-id")
	if i < 0 {
		t.Fatalf("run -h does not list -poll-worker-id:\n%s", help)
	}
	text := help[i:]
	if j := strings.Index(text, "\n  -"); j > 0 {
		text = text[:j]
	}
	if n := strings.Count(text, "(default"); n != 1 {
		t.Errorf("-poll-worker-id's help shows %d defaults, want 1:\n%s", n, text)
	}
	if o, _, code := setup("run", []string{"--source", "poll"}, 0, io.Discard); o == nil || o.poll.WorkerID == "" {
		t.Errorf("without --poll-worker-id the worker id is empty (exit %d)", code)
	}
	if o, _, _ := setup("run", []string{"--poll-worker-id", "w1"}, 0, io.Discard); o == nil || o.poll.WorkerID != "w1" {
		t.Errorf("--poll-worker-id w1 is not taken")
	}
}

// One config file serves every command: keys of another command's flags
// are ignored, unknown keys are still refused, and the command's own keys
// apply.
func TestConfigFileServesEveryCommand(t *testing.T) {
	file := writeConfig(t, "pg-dsn: host=db\ntopic: orders\nkafka-brokers: [k:1]\nretention: 168h\nslot: from_file\n")
	o := &options{}
	if _, err := parse(newFlagSet("migrate", o, &bytes.Buffer{}), o, []string{"--config", file}); err != nil {
		t.Fatal(err)
	}
	if o.relay.Replication.Slot != "from_file" || o.relay.Replication.DSN != "host=db" {
		t.Errorf("migrate did not take its keys: slot %q dsn %q", o.relay.Replication.Slot, o.relay.Replication.DSN)
	}
	file = writeConfig(t, "pg-dsn: host=db\ntopik: orders\n")
	if _, err := parse(newFlagSet("status", o, &bytes.Buffer{}), o, []string{"--config", file}); err == nil || !strings.Contains(err.Error(), `unknown key "topik"`) {
		t.Errorf("err = %v", err)
	}
}

func writeConfig(t *testing.T, content string) string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "relay.yaml")
	if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return file
}

// Only ${VAR} is expanded; $$ is a literal $; a bare $ stays.
func TestConfigFileExpandsOnlyBracedVariables(t *testing.T) {
	t.Setenv("OUTBOX_TEST_PASSWORD", "from-env")
	t.Setenv("word1", "SHOULD-NOT-APPEAR")
	t.Setenv("event", "SHOULD-NOT-APPEAR")
	file := writeConfig(t, `
pg-dsn: "host=db password=pa$word1 user=${OUTBOX_TEST_PASSWORD} dbname=a$$b"
topic: outbox.$event
kafka-brokers: ["${OUTBOX_TEST_PASSWORD}:9092", "k2:9092"]
`)
	o := &options{}
	if _, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, []string{"--config", file}); err != nil {
		t.Fatal(err)
	}
	if got := o.relay.Replication.DSN; got != "host=db password=pa$word1 user=from-env dbname=a$b" {
		t.Errorf("pg-dsn = %q", got)
	}
	if got := o.kafka.TopicTemplate; got != "outbox.$event" {
		t.Errorf("topic = %q", got)
	}
	if got := strings.Join(o.kafka.Brokers, ","); got != "from-env:9092,k2:9092" {
		t.Errorf("brokers = %q", got)
	}
}

// A value of the wrong shape names the key and the format it wants.
func TestConfigFileErrorsNameKeyAndFormat(t *testing.T) {
	for _, tc := range []struct{ yaml, want string }{
		{"kafka-tls: yes", `key kafka-tls: "yes" is not a boolean: use true or false`},
		{"retention: 7d", `key retention: "7d" is not a duration`},
		{"kafka-brokers: {a: 1}", "key kafka-brokers: a mapping is not allowed"},
		{"slot: [a, b]", "key slot: a list is not allowed"},
		{"max-in-flight-events: lots", `key max-in-flight-events: "lots" is not a whole number`},
		{"pg-dsn: ${OUTBOX_TEST_UNSET_VARIABLE}", "OUTBOX_TEST_UNSET_VARIABLE"},
		{"- just\n- a list", "want a map of flag names"},
	} {
		o := &options{}
		_, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, []string{"--config", writeConfig(t, tc.yaml)})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: err = %v, want it to contain %q", tc.yaml, err, tc.want)
		}
	}
	// The environment gets the same explanation.
	t.Setenv("OUTBOX_RELAY_RETENTION", "7d")
	o := &options{}
	_, err := parse(newFlagSet("run", o, &bytes.Buffer{}), o, nil)
	if err == nil || !strings.Contains(err.Error(), `OUTBOX_RELAY_RETENTION: "7d" is not a duration`) {
		t.Errorf("env: err = %v", err)
	}
}

func TestVersionFallsBackToBuildInfo(t *testing.T) {
	withRevision := &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.modified", Value: "true"}}}
	for _, tc := range []struct {
		stamped string
		info    *debug.BuildInfo
		want    string
	}{
		{"1.4.0", withRevision, "1.4.0"},
		{"", &debug.BuildInfo{Main: debug.Module{Version: "v1.5.0"}}, "v1.5.0"},
		{"", withRevision, "dev-abc123-dirty"},
		{"", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, "dev"},
		{"", nil, "dev"},
	} {
		if got := versionFrom(tc.stamped, tc.info); got != tc.want {
			t.Errorf("versionFrom(%q, %+v) = %q, want %q", tc.stamped, tc.info, got, tc.want)
		}
	}
}

func TestLogDurationsWithUnits(t *testing.T) {
	saved := zerolog.DurationFieldFormat
	t.Cleanup(func() { zerolog.DurationFieldFormat = saved })
	logDurationsWithUnits()
	var buf bytes.Buffer
	log := zerolog.New(&buf)
	log.Info().Dur("status_every", time.Second).Dur("retry_in", 349200*time.Microsecond).Send()
	if !strings.Contains(buf.String(), `"status_every":"1s"`) || !strings.Contains(buf.String(), `"retry_in":"349.2ms"`) {
		t.Errorf("log line %s", buf.String())
	}
}

// Issue 24.9: --log-level took trace, fatal, panic and disabled although
// its help lists four values, and with disabled or panic a failing command
// exited 1 printing nothing. Only the four listed levels are taken.
func TestLogLevelTakesOnlyTheListedLevels(t *testing.T) {
	for _, level := range []string{"trace", "fatal", "panic", "disabled", "INFO", ""} {
		code, _, stderr := runCaptured("migrate", "--pg-dsn", deadDSN(t), "--log-level", level)
		if code != exitUsage || !strings.Contains(stderr, "--log-level") {
			t.Errorf("--log-level %q: exit %d, want %d naming --log-level:\n%s", level, code, exitUsage, stderr)
		}
	}
	for _, level := range []string{"debug", "info", "warn", "error"} {
		code, _, stderr := runCaptured("migrate", "--pg-dsn", deadDSN(t), "--log-level", level)
		if code != exitFailure || !strings.Contains(stderr, "outbox-relay migrate:") {
			t.Errorf("--log-level %s against a dead server: exit %d, want %d with the error as the last line:\n%s", level, code, exitFailure, stderr)
		}
	}
}

// Issue 24.13: migrate --slot-only --skip-slot exited 0 doing nothing,
// --print-sql was documented as "without the slot" but printed it, and
// --print-sql --slot-only printed all the table SQL. The flags now
// contradict loudly, and --print-sql prints what migrate with the same
// flags would create.
func TestMigrateFlagsAgree(t *testing.T) {
	if code, _, stderr := runCaptured("migrate", "--pg-dsn", deadDSN(t), "--slot-only", "--skip-slot"); code != exitUsage || !strings.Contains(stderr, "--slot-only and --skip-slot") {
		t.Errorf("--slot-only --skip-slot: exit %d, want %d:\n%s", code, exitUsage, stderr)
	}
	const slot, table = "pg_create_logical_replication_slot", "CREATE TABLE"
	for _, tc := range []struct {
		flags           []string
		tables, slotSQL bool
	}{
		{nil, true, true},
		{[]string{"--skip-slot"}, true, false},
		{[]string{"--slot-only"}, false, true},
	} {
		code, stdout, stderr := runCaptured(append([]string{"migrate", "--print-sql"}, tc.flags...)...)
		if code != exitOK || strings.Contains(stdout, table) != tc.tables || strings.Contains(stdout, slot) != tc.slotSQL {
			t.Errorf("--print-sql %v: exit %d, want tables %v and slot %v:\n%s%s", tc.flags, code, tc.tables, tc.slotSQL, stdout, stderr)
		}
	}
}

// Issue 24.15: `quarantine replay not-a-uuid` said the event "is not
// quarantined" (exit 1) instead of calling the id invalid (exit 2).
func TestReplayRefusesAnIDThatIsNoUUID(t *testing.T) {
	code, _, stderr := runCaptured("quarantine", "replay", "not-a-uuid", "--pg-dsn", deadDSN(t), "--kafka-brokers", "k:1")
	if code != exitUsage || !strings.Contains(stderr, `"not-a-uuid" is not an event id`) {
		t.Errorf("exit %d, want %d calling the id invalid:\n%s", code, exitUsage, stderr)
	}
	for _, id := range []string{"6f1c2d3e-4b5a-4c7d-8e9f-0a1b2c3d4e5f", "{6F1C2D3E4B5A4C7D8E9F0A1B2C3D4E5F}"} {
		if !isUUID(id) {
			t.Errorf("%s refused", id)
		}
	}
}

// A Kafka failure reaches the operator with what to do about it exactly
// once, however it was wrapped on its way out: the message of a
// sink.Error no longer carries its advice, so the places it leaves
// the program add it. One *Error inside another printed it twice before.
func TestOperatorReadsKafkaAdviceOnce(t *testing.T) {
	dsn := "postgres://relay:hunter2@db/app"
	perr := &sink.Error{Class: sink.ClassPermanent, EventID: "e1", Topic: "outbox.event.order", Partition: -1,
		Err: fmt.Errorf("%w: topic does not exist and the brokers did not create it (%s)", sarama.ErrUnknownTopicOrPartition, dsn)}
	advice := perr.Advice()
	for how, err := range map[string]error{
		"wrapped":        fmt.Errorf("session: %w", fmt.Errorf("publish: %w", perr)),
		"inside another": &sink.Error{Class: perr.Class, EventID: "e1", Topic: perr.Topic, Partition: -1, Err: fmt.Errorf("replay: %w", perr)},
	} {
		var stderr bytes.Buffer
		if code := failure(&stderr, "quarantine", err, dsn); code != exitFailure {
			t.Errorf("%s: exit code %d", how, code)
		}
		// run logs operatorMessage as its last line; the other commands
		// print it through failure.
		for where, out := range map[string]string{"a command's exit message": stderr.String(), "run's last log line": operatorMessage(err, dsn)} {
			if n := strings.Count(out, advice); n != 1 {
				t.Errorf("%s, %s: the advice appears %d times: %s", how, where, n, out)
			}
			if strings.Contains(out, "hunter2") {
				t.Errorf("%s, %s: shows the password: %s", how, where, out)
			}
		}
	}
}

// A tracing setting that can never work exits 2 at start-up naming its
// flag, whether it came from the flag, OUTBOX_RELAY_OTEL_* or the
// OpenTelemetry variable beneath them.
func TestRunRefusesBadTracingSettings(t *testing.T) {
	dsn := deadDSN(t)
	base := []string{"run", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1"}
	for _, tc := range []struct {
		flags []string
		env   map[string]string
		named string
	}{
		{flags: []string{"--otel-traces-exporter", "zipkin"}, named: "--otel-traces-exporter"},
		{flags: []string{"--otel-traces-exporter", "otlp", "--otel-exporter-otlp-protocol", "http/json"}, named: "--otel-exporter-otlp-protocol"},
		{flags: []string{"--otel-traces-exporter", "otlp", "--otel-exporter-otlp-endpoint", "127.0.0.1:4318"}, named: "--otel-exporter-otlp-endpoint"},
		{flags: []string{"--otel-traces-sampler-arg", "1.5"}, env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "traceidratio"}, named: "--otel-traces-sampler-arg"},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "often"}, named: "OTEL_TRACES_SAMPLER"},
		{env: map[string]string{"OUTBOX_RELAY_OTEL_TRACES_EXPORTER": "otlp", "OUTBOX_RELAY_OTEL_TRACES_SAMPLER": "often"}, named: "--otel-traces-sampler"},
	} {
		for k, v := range tc.env {
			t.Setenv(k, v)
		}
		code, _, stderr := runCaptured(append(base, tc.flags...)...)
		if code != exitUsage || !strings.Contains(stderr, tc.named) {
			t.Errorf("%v %v: exit %d, want %d naming %s:\n%s", tc.flags, tc.env, code, exitUsage, tc.named, stderr)
		}
		for k := range tc.env {
			os.Unsetenv(k)
		}
	}
}
