package ops

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// deployFile is the path of a file in deploy/, from this package's
// directory.
func deployFile(name string) string { return filepath.Join("..", "..", "deploy", name) }

// flagDefaults returns every flag of `outbox-relay run` with the default
// its help shows ("" when none is shown, as for false booleans).
func flagDefaults(t *testing.T) map[string]string {
	t.Helper()
	p := harness.StartProcess(t, harness.BuildRelay(t), []string{"run", "-h"}, nil)
	if code, err := p.Wait(time.Minute); err != nil || code != 0 {
		t.Fatalf("run -h: exit %d (%v)", code, err)
	}
	flags := map[string]string{}
	var last string
	for _, line := range strings.Split(p.Output(), "\n") {
		if m := regexp.MustCompile(`^  -([a-z0-9-]+)`).FindStringSubmatch(line); m != nil {
			last = m[1]
			flags[last] = ""
		}
		if m := regexp.MustCompile(`\(default "?([^")]*)"?\)$`).FindStringSubmatch(line); m != nil && last != "" {
			flags[last] = m[1]
		}
	}
	if len(flags) < 20 {
		t.Fatalf("found only %d flags in run -h:\n%s", len(flags), p.Output())
	}
	return flags
}

// installedBinary is where the Debian package puts the relay, and where
// both units start it from.
const installedBinary = "/usr/bin/outbox-relay"

// unitDirective is one Key=Value line of a unit file, in its section.
type unitDirective struct{ Section, Key, Value string }

// readUnit returns a unit file of deploy/ and its directives in order,
// without comments and blank lines.
func readUnit(t *testing.T, name string) (text string, directives []unitDirective) {
	t.Helper()
	raw, err := os.ReadFile(deployFile(name))
	if err != nil {
		t.Fatal(err)
	}
	var section string
	for i, line := range strings.Split(string(raw), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";"):
		case strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]"):
			section = line
		case strings.HasSuffix(line, "\\"):
			t.Fatalf("%s:%d: continued lines are not supported here", name, i+1)
		default:
			key, value, ok := strings.Cut(line, "=")
			if !ok || section == "" {
				t.Fatalf("%s:%d: not a Key=Value line in a section: %q", name, i+1, line)
			}
			directives = append(directives, unitDirective{section, strings.TrimSpace(key), strings.TrimSpace(value)})
		}
	}
	return string(raw), directives
}

// unitValues are the values key has in directives, in order.
func unitValues(directives []unitDirective, key string) []string {
	var out []string
	for _, d := range directives {
		if d.Key == key {
			out = append(out, d.Value)
		}
	}
	return out
}

// The unit file must load in systemd: systemd-analyze verify, run against a
// copy whose ExecStart points at the built relay (verify insists the binary
// exists). The template unit must load as an instance too, and rate the
// same exposure. Works as root in a container without systemd as PID 1.
func TestSystemdUnitVerifies(t *testing.T) {
	t.Parallel()
	analyze := harness.RequireTool(t, "systemd-analyze", "systemd", "OUTBOX_RELAY_REQUIRE_SYSTEMD_ANALYZE")
	text, _ := readUnit(t, "outbox-relay.service")
	if !strings.Contains(text, "ExecStart="+installedBinary+" run --config /etc/outbox-relay/outbox-relay.yaml") {
		t.Fatalf("ExecStart is not %s run --config /etc/outbox-relay/outbox-relay.yaml", installedBinary)
	}
	for _, want := range []string{"Type=notify", "Restart=always", "StartLimitIntervalSec=0", "User=outbox-relay",
		"NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "CapabilityBoundingSet=\n",
		"RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX", "SystemCallFilter=@system-service", "EnvironmentFile=-/etc/outbox-relay/env",
		"ProtectKernelTunables=yes", "ProtectControlGroups=yes", "LockPersonality=yes", "RestrictNamespaces=yes", "MemoryMax="} {
		if !strings.Contains(text, "\n"+want) {
			t.Errorf("the unit lacks %q", strings.TrimSpace(want))
		}
	}
	// The drain must end before systemd's SIGKILL, and the watchdog must
	// leave the stream loop (which pings once per --status-interval) room.
	defaults := flagDefaults(t)
	setting := func(key string) time.Duration {
		m := regexp.MustCompile(`(?m)^` + key + `=(\S+)$`).FindStringSubmatch(text)
		if m == nil {
			t.Fatalf("the unit has no %s=", key)
		}
		d, err := time.ParseDuration(strings.Replace(m[1], "min", "m", 1))
		if err != nil {
			t.Fatalf("%s=%s: %v", key, m[1], err)
		}
		return d
	}
	shutdown, err := time.ParseDuration(defaults["shutdown-timeout"])
	if err != nil {
		t.Fatalf("default --shutdown-timeout %q: %v", defaults["shutdown-timeout"], err)
	}
	if stop := setting("TimeoutStopSec"); stop < shutdown+10*time.Second {
		t.Errorf("TimeoutStopSec=%v leaves less than 10s beyond --shutdown-timeout %v", stop, shutdown)
	}
	status, err := time.ParseDuration(defaults["status-interval"])
	if err != nil {
		t.Fatal(err)
	}
	if wd := setting("WatchdogSec"); wd < 10*status {
		t.Errorf("WatchdogSec=%v is less than ten --status-interval (%v)", wd, status)
	}

	dir := t.TempDir()
	bin := filepath.Join(dir, "outbox-relay")
	raw, err := os.ReadFile(harness.BuildRelay(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, raw, 0o755); err != nil {
		t.Fatal(err)
	}
	unitScore, rated := analyzeUnit(t, analyze, dir, bin, "outbox-relay.service", "outbox-relay.service")
	instanceScore, _ := analyzeUnit(t, analyze, dir, bin, "outbox-relay@.service", "outbox-relay@orders.service")
	if !rated {
		return
	}
	if unitScore > 2.0 {
		t.Errorf("exposure %.1f: the hardening of outbox-relay.service regressed (1.2 when written)", unitScore)
	}
	if instanceScore != unitScore {
		t.Errorf("exposure of outbox-relay@orders.service %.1f, of outbox-relay.service %.1f: the template must be hardened the same", instanceScore, unitScore)
	}
}

// analyzeUnit copies file of deploy/ into dir with ExecStart pointing at
// bin, runs systemd-analyze verify on unit (file itself, or an instance of
// the template file) and returns its offline exposure score; rated is
// false where this systemd cannot rate a unit file offline (before 250).
func analyzeUnit(t *testing.T, analyze, dir, bin, file, unit string) (score float64, rated bool) {
	t.Helper()
	text, _ := readUnit(t, file)
	if err := os.WriteFile(filepath.Join(dir, file), []byte(strings.ReplaceAll(text, installedBinary, bin)), 0o644); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, unit)
	out, err := harness.RunTool(t, analyze, "verify", "--man=no", path)
	t.Logf("systemd-analyze verify %s:\n%s", unit, out)
	if err != nil {
		t.Fatalf("systemd-analyze verify %s: %v\n%s", unit, err, out)
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, file) || strings.Contains(line, unit) {
			t.Errorf("systemd-analyze verify complains: %s", line)
		}
	}
	out, err = harness.RunTool(t, analyze, "security", "--offline=yes", path)
	m := regexp.MustCompile(`Overall exposure level for ` + regexp.QuoteMeta(unit) + `: ([0-9.]+)`).FindStringSubmatch(out)
	if err != nil || m == nil {
		t.Logf("systemd-analyze security --offline is not available here (%v); skipping the exposure score", err)
		return 0, false
	}
	score, err = strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatalf("exposure %q of %s: %v", m[1], unit, err)
	}
	t.Logf("systemd-analyze security exposure of %s: %.1f (0 best, 10 worst)", unit, score)
	return score, true
}

// The template unit outbox-relay@.service is outbox-relay.service with the
// instance name in its description, config file and per-instance secrets:
// every other setting, the hardening above all, is the same, in the same
// order, so the two cannot drift apart.
func TestTemplateUnitMatchesUnit(t *testing.T) {
	t.Parallel()
	_, unit := readUnit(t, "outbox-relay.service")
	_, template := readUnit(t, "outbox-relay@.service")
	const config = "/etc/outbox-relay/outbox-relay.yaml"
	execStart := unitValues(unit, "ExecStart")
	if len(execStart) != 1 || !strings.HasSuffix(execStart[0], " --config "+config) {
		t.Fatalf("outbox-relay.service: ExecStart %q does not end in --config %s", execStart, config)
	}
	// Each instance's own config file and secrets.
	want := map[string][]string{
		"ExecStart":       {strings.TrimSuffix(execStart[0], config) + "/etc/outbox-relay/%i.yaml"},
		"EnvironmentFile": append(unitValues(unit, "EnvironmentFile"), "-/etc/outbox-relay/%i.env"),
	}
	for key, values := range want {
		if got := unitValues(template, key); !slices.Equal(got, values) {
			t.Errorf("outbox-relay@.service: %s %q, want %q", key, got, values)
		}
	}
	if d := unitValues(template, "Description"); len(d) != 1 || !strings.Contains(d[0], "%i") {
		t.Errorf("outbox-relay@.service: Description %q does not name the instance (%%i)", d)
	}
	// Directories systemd creates for a unit are the instance's own.
	perInstance := []string{"StateDirectory", "RuntimeDirectory", "CacheDirectory", "LogsDirectory", "ConfigurationDirectory"}
	for _, key := range perInstance {
		var values []string
		for _, v := range unitValues(unit, key) {
			values = append(values, strings.ReplaceAll(v, "outbox-relay", "outbox-relay/%i"))
		}
		if got := unitValues(template, key); !slices.Equal(got, values) {
			t.Errorf("outbox-relay@.service: %s %q, want %q", key, got, values)
		}
	}
	rest := func(ds []unitDirective) []unitDirective {
		return slices.DeleteFunc(slices.Clone(ds), func(d unitDirective) bool {
			return d.Key == "Description" || slices.Contains(perInstance, d.Key) || want[d.Key] != nil
		})
	}
	u, tm := rest(unit), rest(template)
	for i := range max(len(u), len(tm)) {
		var a, b unitDirective
		if i < len(u) {
			a = u[i]
		}
		if i < len(tm) {
			b = tm[i]
		}
		if a != b {
			t.Fatalf("setting %d differs: outbox-relay.service has %s %s=%s, outbox-relay@.service %s %s=%s",
				i+1, a.Section, a.Key, a.Value, b.Section, b.Key, b.Value)
		}
	}
	if len(u) < 40 {
		t.Fatalf("only %d settings compared: the units were not read", len(u))
	}
}

// The example config documents every flag of `run` (set, or commented
// out), sets only real flags, shows the defaults where it says so, and
// works: a relay started with it streams.
func TestExampleConfig(t *testing.T) {
	t.Parallel()
	path := deployFile("outbox-relay.yaml")
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	defaults := flagDefaults(t)
	documented := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^(?:# )?([a-z][a-z0-9-]*):`).FindAllStringSubmatch(string(raw), -1) {
		documented[m[1]] = true
	}
	for flag := range defaults {
		if flag != "config" && !documented[flag] {
			t.Errorf("the example config does not document --%s", flag)
		}
	}
	var active map[string]any
	if err := yaml.Unmarshal(raw, &active); err != nil {
		t.Fatalf("the example config is not YAML: %v", err)
	}
	// Deliberately not the defaults: where to connect, and TLS on.
	examples := map[string]bool{"pg-dsn": true, "kafka-brokers": true, "kafka-tls": true}
	for key, v := range active {
		def, ok := defaults[key]
		if !ok {
			t.Errorf("the example config sets %q, which is not a flag of run", key)
			continue
		}
		if examples[key] {
			continue
		}
		got := fmt.Sprint(v)
		if def == "" && got == "false" {
			continue
		}
		if dg, e1 := time.ParseDuration(got); e1 == nil {
			if dd, e2 := time.ParseDuration(def); e2 == nil && dd == dg {
				continue
			}
		}
		if got != def {
			t.Errorf("the example config sets %s: %s, but the default is %q", key, got, def)
		}
	}

	// It works as it is, with only the environment-specific values
	// overridden by flags (which win over the file).
	e := newEnv(t)
	e.Migrate()
	p := e.start(e.Args("run", "--config", path, "--kafka-tls=false"))
	p.WaitForOutput(t, `"message":"streaming"`, time.Minute)
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, insert(t, e.DB.DSN(), "order", 3), time.Minute)

	// The standard collectors the dashboard and the alerts use exist.
	families := harness.Scrape(t, p.AdminURL(t))
	for name := range referencedSeries(t) {
		if !strings.HasPrefix(name, "outbox_relay_") && name != "up" && families[name] == nil {
			t.Errorf("the dashboard or the alerts use %s, which /metrics does not have", name)
		}
	}
}

// declaredSeries are the series the sources declare, with the _bucket,
// _sum and _count series of their latency histograms.
func declaredSeries(t *testing.T) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, name := range append(metricNames(t), pollMetricNames(t)...) {
		out[name] = true
	}
	for _, file := range []string{filepath.Join("relay", "metrics.go"), filepath.Join("poll", "metrics.go")} {
		src, err := os.ReadFile(filepath.Join("..", "..", file))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range regexp.MustCompile(`\bs\.Latency\("([a-z0-9_]+)"`).FindAllStringSubmatch(string(src), -1) {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				out[m[1]+suffix] = true
			}
		}
	}
	return out
}

var seriesName = regexp.MustCompile(`\b(?:outbox_relay_[a-z0-9_]+|process_[a-z0-9_]+|go_[a-z0-9_]+|up)\b`)

// alertRule is one rule of deploy/prometheus-alerts.yaml.
type alertRule struct {
	Alert       string            `yaml:"alert"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

type ruleFile struct {
	Groups []struct {
		Name  string      `yaml:"name"`
		Rules []alertRule `yaml:"rules"`
	} `yaml:"groups"`
}

func readRules(t *testing.T) ruleFile {
	t.Helper()
	raw, err := os.ReadFile(deployFile("prometheus-alerts.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var rf ruleFile
	if err := yaml.Unmarshal(raw, &rf); err != nil {
		t.Fatalf("prometheus-alerts.yaml: %v", err)
	}
	return rf
}

type dashboard struct {
	Title  string `json:"title"`
	UID    string `json:"uid"`
	Panels []struct {
		ID      int    `json:"id"`
		Type    string `json:"type"`
		Title   string `json:"title"`
		GridPos *struct {
			X, Y, W, H int
		} `json:"gridPos"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	raw, err := os.ReadFile(deployFile(filepath.Join("grafana", "outbox-relay.json")))
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("grafana/outbox-relay.json is not valid JSON: %v", err)
	}
	return d
}

// referencedSeries is every series the dashboard and the alert rules use.
func referencedSeries(t *testing.T) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			for _, n := range seriesName.FindAllString(r.Expr, -1) {
				out[n] = true
			}
		}
	}
	for _, p := range readDashboard(t).Panels {
		for _, target := range p.Targets {
			for _, n := range seriesName.FindAllString(target.Expr, -1) {
				out[n] = true
			}
		}
	}
	return out
}

// Every alert is complete and uses only series the relay exports; promtool
// accepts the file and the rules fire (and stay quiet) as intended.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	rf := readRules(t)
	declared := declaredSeries(t)
	names := map[string]bool{}
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" || names[r.Alert] {
				t.Errorf("rule %q: missing or duplicate alert name", r.Alert)
			}
			names[r.Alert] = true
			if strings.TrimSpace(r.Expr) == "" || r.For == "" {
				t.Errorf("%s: needs expr and for", r.Alert)
			}
			if _, err := time.ParseDuration(r.For); err != nil {
				t.Errorf("%s: for %q: %v", r.Alert, r.For, err)
			}
			// info: something the relay handled by itself that an operator
			// should hear of, never a page.
			if s := r.Labels["severity"]; s != "critical" && s != "warning" && s != "info" {
				t.Errorf("%s: labels.severity %q, want critical, warning or info", r.Alert, s)
			}
			if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("%s: needs annotations.summary and annotations.description", r.Alert)
			}
			used := seriesName.FindAllString(r.Expr, -1)
			if len(used) == 0 {
				t.Errorf("%s: the expression uses no relay series: %s", r.Alert, r.Expr)
			}
			for _, n := range used {
				if strings.HasPrefix(n, "outbox_relay_") && !declared[n] {
					t.Errorf("%s: %s is not a series any source declares", r.Alert, n)
				}
			}
		}
	}
	// What the operator asked to be alerted on.
	for _, want := range []string{"OutboxRelayDown", "OutboxRelayNotStreaming", "OutboxRelaySlotInactive",
		"OutboxRelaySlotRetainsTooMuchWAL", "OutboxRelayOldestEventTooOld", "OutboxRelayStalled",
		"OutboxRelayRestartingOften", "OutboxRelayPublishErrors", "OutboxRelayQuarantineNotEmpty"} {
		if !names[want] {
			t.Errorf("no %s alert", want)
		}
	}

	promtool := harness.RequireTool(t, "promtool", "prometheus", "OUTBOX_RELAY_REQUIRE_PROMTOOL")
	if out, err := harness.RunTool(t, promtool, "check", "rules", deployFile("prometheus-alerts.yaml")); err != nil {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}
	// promtool test rules compares annotations verbatim; the expressions
	// are what matter here, so test a copy without annotations.
	for gi := range rf.Groups {
		for ri := range rf.Groups[gi].Rules {
			rf.Groups[gi].Rules[ri].Annotations = nil
		}
	}
	stripped, err := yaml.Marshal(rf)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), stripped, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "rules_test.yaml"), []byte(alertTests), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := harness.RunTool(t, promtool, "test", "rules", filepath.Join(dir, "rules_test.yaml")); err != nil {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
}

// alertTests are promtool unit tests of the rules' expressions.
const alertTests = `
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  # Partitions added to one topic: fires after 5 minutes; a topic whose
  # count is the one its keys are mapped by stays quiet.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_topic_partitions{job="outbox-relay", instance="a", topic="orders"}'
        values: '6 6 12x20'
      - series: 'outbox_relay_topic_partitions_used{job="outbox-relay", instance="a", topic="orders"}'
        values: '6x22'
      - series: 'outbox_relay_topic_partitions{job="outbox-relay", instance="a", topic="invoices"}'
        values: '3x22'
      - series: 'outbox_relay_topic_partitions_used{job="outbox-relay", instance="a", topic="invoices"}'
        values: '3x22'
    alert_rule_test:
      - {eval_time: 5m, alertname: OutboxRelayTopicPartitionsChanged, exp_alerts: []}
      - eval_time: 10m
        alertname: OutboxRelayTopicPartitionsChanged
        exp_alerts: [{exp_labels: {job: outbox-relay, topic: orders, severity: warning}}]

  # The slot has no consumer: fires after 5 minutes, not before.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_slot_active{job="outbox-relay", instance="a"}'
        values: '1 1 0x20'
    alert_rule_test:
      - {eval_time: 5m, alertname: OutboxRelaySlotInactive, exp_alerts: []}
      - eval_time: 10m
        alertname: OutboxRelaySlotInactive
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: critical}}]

  # An HA pair: the standby waiting is fine while the other streams; when
  # neither streams the job alerts.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_state{job="outbox-relay", instance="a", state="streaming"}'
        values: '1x10 0x10'
      - series: 'outbox_relay_state{job="outbox-relay", instance="b", state="streaming"}'
        values: '0x20'
      - series: 'outbox_relay_state{job="outbox-relay", instance="b", state="waiting-for-slot"}'
        values: '1x20'
    alert_rule_test:
      - {eval_time: 9m, alertname: OutboxRelayNotStreaming, exp_alerts: []}
      - eval_time: 18m
        alertname: OutboxRelayNotStreaming
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: critical}}]

  # Poll mode exports streaming at 0 beside polling: a poller that polls
  # is running, one that stops polling alerts like a relay.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_state{job="poller", instance="a", state="streaming"}'
        values: '0x20'
      - series: 'outbox_relay_state{job="poller", instance="a", state="polling"}'
        values: '1x10 0x10'
    alert_rule_test:
      - {eval_time: 9m, alertname: OutboxRelayNotStreaming, exp_alerts: []}
      - eval_time: 18m
        alertname: OutboxRelayNotStreaming
        exp_alerts: [{exp_labels: {job: poller, severity: critical}}]

  # A relay that never published anything while the slot lags is stalled;
  # one that publishes is not, whatever the lag.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_slot_lag_bytes{job="stuck", instance="a"}'
        values: '300000000x40'
      - series: 'outbox_relay_slot_lag_bytes{job="busy", instance="b"}'
        values: '300000000x40'
      - series: 'outbox_relay_events_published_total{job="busy", instance="b", topic="t"}'
        values: '0+100x40'
    alert_rule_test:
      - eval_time: 30m
        alertname: OutboxRelayStalled
        exp_alerts: [{exp_labels: {job: stuck, severity: critical}}]

  # A start that created the slot after the progress record: one gap is
  # enough, at once, and not before it happened.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_slot_gaps_total{job="outbox-relay", instance="a"}'
        values: '0 0 0 1x10'
    alert_rule_test:
      - {eval_time: 2m, alertname: OutboxRelaySlotGap, exp_alerts: []}
      - eval_time: 4m
        alertname: OutboxRelaySlotGap
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: critical}}]

  # A slot recovered by the relay itself is told, as information, at once;
  # a refused recovery is not a recovered one (the relay stops and the
  # down and not-streaming alerts page).
  - interval: 1m
    input_series:
      - series: 'outbox_relay_slot_recoveries_total{job="outbox-relay", instance="a", result="recovered"}'
        values: '0 0 0 1x10'
      - series: 'outbox_relay_slot_recoveries_total{job="refused", instance="b", result="refused"}'
        values: '0 0 0 1x10'
      - series: 'outbox_relay_slot_recoveries_total{job="refused", instance="b", result="recovered"}'
        values: '0x13'
    alert_rule_test:
      - {eval_time: 2m, alertname: OutboxRelaySlotRecovered, exp_alerts: []}
      - eval_time: 4m
        alertname: OutboxRelaySlotRecovered
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: info}}]

  # A slot made over rows by choice, or unchecked, warns at once; one made
  # over an empty table, or recovering the rows, does not.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_slots_created_total{job="outbox-relay", instance="a", existing_rows="published"}'
        values: '0 0 0 1x10'
      - series: 'outbox_relay_slots_created_total{job="fine", instance="b", existing_rows="none"}'
        values: '0 0 0 1x10'
      - series: 'outbox_relay_slots_created_total{job="fine", instance="b", existing_rows="pending"}'
        values: '0 0 0 1x10'
    alert_rule_test:
      - {eval_time: 2m, alertname: OutboxRelaySlotMadeOverUnpublishedRows, exp_alerts: []}
      - eval_time: 4m
        alertname: OutboxRelaySlotMadeOverUnpublishedRows
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: warning}}]

  # A cleanup that fails at every pass alerts; one failure does not.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_retention_failures_total{job="failing", instance="a"}'
        values: '0+1x40'
      - series: 'outbox_relay_retention_failures_total{job="blip", instance="b"}'
        values: '0 0 1x40'
    alert_rule_test:
      - eval_time: 20m
        alertname: OutboxRelayRetentionFailing
        exp_alerts: [{exp_labels: {job: failing, severity: warning}}]

  # Slot gauges from a reading over two minutes old: PostgreSQL is away.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_slot_reading_age_seconds{job="outbox-relay", instance="a"}'
        values: '5 5 5 65 125 185 245 305'
    alert_rule_test:
      - {eval_time: 4m, alertname: OutboxRelaySlotReadingStale, exp_alerts: []}
      - eval_time: 6m
        alertname: OutboxRelaySlotReadingStale
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: warning}}]

  # The slot's headroom: short for 10 minutes fires; no limit (+Inf) and
  # a short spell do not.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_slot_time_left_seconds{job="outbox-relay", instance="a"}'
        values: '3600 3600 600x15'
      - series: 'outbox_relay_slot_time_left_seconds{job="nolimit", instance="b"}'
        values: 'Inf Inf Inf Inf Inf Inf Inf Inf Inf Inf Inf Inf Inf Inf Inf Inf Inf Inf'
      - series: 'outbox_relay_slot_time_left_seconds{job="spell", instance="c"}'
        values: '600x5 3600x12'
    alert_rule_test:
      - {eval_time: 8m, alertname: OutboxRelaySlotTimeLeftShort, exp_alerts: []}
      - eval_time: 13m
        alertname: OutboxRelaySlotTimeLeftShort
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: warning}}]

  # Quarantine, down, WAL at risk, old events, restarts, permanent errors.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_quarantined_events{job="outbox-relay", instance="a"}'
        values: '0 0 2x10'
      - series: 'up{job="outbox-relay", instance="a"}'
        values: '1 1 0x10'
      - series: 'outbox_relay_slot_wal_status{job="outbox-relay", instance="a", wal_status="unreserved"}'
        values: '0 0 1x10'
      - series: 'outbox_relay_slot_wal_status{job="outbox-relay", instance="a", wal_status="reserved"}'
        values: '1 1 0x10'
      - series: 'outbox_relay_oldest_unpublished_event_age_seconds{job="outbox-relay", instance="a"}'
        values: '0 0 120x10'
      - series: 'outbox_relay_stream_restarts_total{job="outbox-relay", instance="a"}'
        values: '0+1x20'
      - series: 'outbox_relay_publish_errors_total{job="outbox-relay", instance="a", class="permanent"}'
        values: '0 0 0 1x10'
      - series: 'outbox_relay_publish_errors_total{job="outbox-relay", instance="a", class="retriable"}'
        values: '0 0 0 5x10'
    alert_rule_test:
      - eval_time: 5m
        alertname: OutboxRelayQuarantineNotEmpty
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: warning}}]
      - eval_time: 5m
        alertname: OutboxRelayDown
        exp_alerts: [{exp_labels: {job: outbox-relay, instance: a, severity: critical}}]
      - eval_time: 3m
        alertname: OutboxRelaySlotWALAtRisk
        exp_alerts: [{exp_labels: {job: outbox-relay, wal_status: unreserved, severity: critical}}]
      - eval_time: 5m
        alertname: OutboxRelayOldestEventTooOld
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: warning}}]
      - eval_time: 10m
        alertname: OutboxRelayRestartingOften
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: warning}}]
      - eval_time: 5m
        alertname: OutboxRelayPublishErrors
        exp_alerts: [{exp_labels: {job: outbox-relay, class: permanent, severity: warning}}]

  # Periodic reconcile: missing events fire at once; a check that stops
  # completing fires, one that is off (interval 0) or just started does not.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_reconcile_missing_events{job="outbox-relay", instance="a"}'
        values: '0 0 3x10'
      - series: 'outbox_relay_reconcile_interval_seconds{job="outbox-relay", instance="a"}'
        values: '60x40'
      - series: 'outbox_relay_reconcile_last_complete_timestamp_seconds{job="outbox-relay", instance="a"}'
        values: '0 60 120 180 180x40'
      - series: 'process_start_time_seconds{job="outbox-relay", instance="a"}'
        values: '0x40'
      - series: 'outbox_relay_reconcile_interval_seconds{job="off", instance="b"}'
        values: '0x40'
      - series: 'outbox_relay_reconcile_last_complete_timestamp_seconds{job="off", instance="b"}'
        values: '0x40'
      - series: 'process_start_time_seconds{job="off", instance="b"}'
        values: '0x40'
      - series: 'outbox_relay_reconcile_interval_seconds{job="fresh", instance="c"}'
        values: '60x40'
      - series: 'outbox_relay_reconcile_last_complete_timestamp_seconds{job="fresh", instance="c"}'
        values: '0x40'
      - series: 'process_start_time_seconds{job="fresh", instance="c"}'
        values: '1800x40'
    alert_rule_test:
      - {eval_time: 1m, alertname: OutboxRelayReconcileMissingEvents, exp_alerts: []}
      - eval_time: 2m
        alertname: OutboxRelayReconcileMissingEvents
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: critical}}]
      - {eval_time: 10m, alertname: OutboxRelayReconcileStale, exp_alerts: []}
      - eval_time: 30m
        alertname: OutboxRelayReconcileStale
        exp_alerts: [{exp_labels: {job: outbox-relay, severity: warning}}]
`

// The dashboard is valid JSON, every panel queries series the relay
// exports, and every series the relay declares is on some panel.
func TestGrafanaDashboard(t *testing.T) {
	t.Parallel()
	d := readDashboard(t)
	if d.Title == "" || d.UID == "" || len(d.Panels) == 0 {
		t.Fatalf("dashboard title %q uid %q with %d panels", d.Title, d.UID, len(d.Panels))
	}
	declared := declaredSeries(t)
	onPanels := map[string]bool{}
	ids := map[int]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if p.GridPos == nil || p.GridPos.W == 0 || p.GridPos.H == 0 {
			t.Errorf("panel %q has no position", p.Title)
		}
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, target := range p.Targets {
			used := seriesName.FindAllString(target.Expr, -1)
			if len(used) == 0 {
				t.Errorf("panel %q: query %q uses no known series", p.Title, target.Expr)
			}
			for _, n := range used {
				onPanels[n] = true
				if strings.HasPrefix(n, "outbox_relay_") && !declared[n] {
					t.Errorf("panel %q: %s is not a series any source declares", p.Title, n)
				}
			}
		}
	}
	for _, n := range metricNames(t) {
		if !onPanels[n] && !onPanels[n+"_bucket"] {
			t.Errorf("no panel shows %s", n)
		}
	}
}

// The metric reference names every series, and every alert rule's
// runbook_url leads to a section of a docs page that exists.
func TestDocsCoverSeriesAndAlerts(t *testing.T) {
	t.Parallel()
	root := filepath.Join("..", "..")
	raw, err := os.ReadFile(filepath.Join(root, "docs", "reference", "metrics.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	for _, n := range append(metricNames(t), pollMetricNames(t)...) {
		if !strings.Contains(doc, "`"+n+"`") {
			t.Errorf("docs/reference/metrics.md does not document %s", n)
		}
	}
	const prefix = "https://github.com/outbox-relay/outbox-relay/blob/main/"
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			url := r.Annotations["runbook_url"]
			page, anchor, ok := strings.Cut(strings.TrimPrefix(url, prefix), "#")
			if !strings.HasPrefix(url, prefix+"docs/") || !ok {
				t.Errorf("%s: runbook_url %q is not %sdocs/<page>.md#<section>", r.Alert, url, prefix)
				continue
			}
			text, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(page)))
			if err != nil {
				t.Errorf("%s: runbook_url: %v", r.Alert, err)
				continue
			}
			if !slices.Contains(headingAnchors(string(text)), anchor) {
				t.Errorf("%s: runbook_url: %s has no section #%s", r.Alert, page, anchor)
			}
		}
	}
}

// headingAnchors are the anchors of a Markdown page's headings, made the
// way GitHub and the docs site make them: lower case, spaces as "-", and
// anything but letters, digits, "-" and "_" dropped.
func headingAnchors(page string) []string {
	var anchors []string
	fenced := false
	for _, line := range strings.Split(page, "\n") {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
		}
		if fenced || !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#")))
		var b strings.Builder
		for _, r := range title {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || ('a' <= r && r <= 'z') || ('0' <= r && r <= '9'):
				b.WriteRune(r)
			}
		}
		anchors = append(anchors, b.String())
	}
	return anchors
}
