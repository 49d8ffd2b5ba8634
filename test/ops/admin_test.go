package ops

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// slotDoc is the /slot document, decoded loosely so the test sees exactly
// which keys are there.
type slotDoc struct {
	Slot      map[string]any `json:"slot"`
	SlotError string         `json:"slot_error"`
	Relay     map[string]any `json:"relay"`
}

func getSlot(t *testing.T, base string) slotDoc {
	t.Helper()
	code, body := harness.HTTPGet(t, base+"/slot")
	if code != http.StatusOK {
		t.Fatalf("GET /slot: %d %s", code, body)
	}
	var doc slotDoc
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatalf("/slot is not JSON: %v\n%s", err, body)
	}
	return doc
}

// metricNames lists the outbox_relay_* series the WAL path exports: those
// every source shares (pipeline/metrics.go), its own (relay/metrics.go,
// relay/progress_metrics.go) and reconcile's, so a series added there is
// checked here without editing this test.
func metricNames(t *testing.T) []string {
	t.Helper()
	names := declaredIn(t, filepath.Join("pipeline", "metrics.go"), filepath.Join("relay", "metrics.go"),
		filepath.Join("reconcile", "metrics.go"), filepath.Join("relay", "progress_metrics.go"))
	sort.Strings(names)
	return names
}

// pollMetricNames are the series poll mode exports: those every source
// shares and its own.
func pollMetricNames(t *testing.T) []string {
	t.Helper()
	return declaredIn(t, filepath.Join("pipeline", "metrics.go"), filepath.Join("poll", "metrics.go"))
}

// seriesDecl finds a series' name where it is declared: in an Opts
// literal, or as the first argument of a pipeline.Series method.
var seriesDecl = regexp.MustCompile(`(?:Name:\s*|\bs\.(?:Counter|CounterVec|Gauge|GaugeVec|Latency)\()"(outbox_relay_[a-z0-9_]+)"`)

// declaredIn lists the series the files declare; each file must declare
// some, so a change of declaration style cannot empty the checks.
func declaredIn(t *testing.T, files ...string) []string {
	t.Helper()
	var names []string
	for _, file := range files {
		src, err := os.ReadFile(filepath.Join("..", "..", file))
		if err != nil {
			t.Fatalf("read %s: %v", file, err)
		}
		found := seriesDecl.FindAllStringSubmatch(string(src), -1)
		if len(found) < 3 {
			t.Fatalf("found only %d metric names in %s", len(found), file)
		}
		for _, m := range found {
			names = append(names, m[1])
		}
	}
	return names
}

func TestAdminEndpoint(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	p := e.StartRelay()
	base := p.AdminURL(t)

	if code, body := harness.HTTPGet(t, base+"/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Errorf("/healthz: %d %q, want 200 ok", code, body)
	}
	if code, body := harness.HTTPGet(t, base+"/readyz"); code != http.StatusOK {
		t.Errorf("/readyz while streaming: %d %q, want 200", code, body)
	}

	// Read-only: no method but GET (and HEAD) does anything.
	for _, path := range []string{"/healthz", "/readyz", "/slot", "/metrics"} {
		for _, method := range []string{http.MethodPost, http.MethodPut, http.MethodDelete} {
			if code, _ := harness.HTTPRequest(t, method, base+path); code != http.StatusMethodNotAllowed {
				t.Errorf("%s %s: %d, want 405", method, path, code)
			}
		}
	}
	if code, _ := harness.HTTPGet(t, base+"/debug/pprof/"); code != http.StatusNotFound {
		t.Errorf("GET /debug/pprof/: %d, want 404 (no profiling endpoint on the admin port)", code)
	}

	// Events flow: the per-topic counters move by exactly what was written.
	before := harness.Scrape(t, base)
	if _, ok := harness.MetricValue(before, "outbox_relay_events_published_total", "topic", "outbox.event.order"); ok {
		t.Fatalf("events counted for topic outbox.event.order before any was written")
	}
	ids := append(insert(t, e.DB.DSN(), "order", 5), insert(t, e.DB.DSN(), "invoice", 3)...)
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, ids, time.Minute)
	harness.WaitFor(t, 30*time.Second, "the published counters to reach 5 and 3", func() bool {
		f := harness.Scrape(t, base)
		order, _ := harness.MetricValue(f, "outbox_relay_events_published_total", "topic", "outbox.event.order")
		invoice, _ := harness.MetricValue(f, "outbox_relay_events_published_total", "topic", "outbox.event.invoice")
		return order >= 5 && invoice >= 3
	})
	after := harness.Scrape(t, base)
	for topic, want := range map[string]float64{"outbox.event.order": 5, "outbox.event.invoice": 3} {
		if got, _ := harness.MetricValue(after, "outbox_relay_events_published_total", "topic", topic); got != want {
			t.Errorf("events published to %s: %v, want %v", topic, got, want)
		}
		if bytes, _ := harness.MetricValue(after, "outbox_relay_bytes_published_total", "topic", topic); bytes < want*20 {
			t.Errorf("bytes published to %s: %v for %v events", topic, bytes, want)
		}
	}
	if n, _ := harness.MetricValue(after, "outbox_relay_commit_to_ack_seconds"); n < 8 {
		t.Errorf("commit-to-ack histogram counted %v events, want 8", n)
	}
	// One observation per transaction, at its first row.
	if n, _ := harness.MetricValue(after, "outbox_relay_commit_to_receive_seconds"); n < 1 || n > 8 {
		t.Errorf("commit-to-receive histogram counted %v transactions, want 1 to 8", n)
	}

	// Every series the WAL path declares is exposed, with the Go and
	// process collectors. Only the order-break counter and the count of
	// partition counts recorded over a topic's earlier records have no
	// series before their first event: their labels (topic, partition)
	// are not known in advance.
	for _, name := range metricNames(t) {
		if after[name] == nil && name != "outbox_relay_order_breaks_total" && name != "outbox_relay_topic_partitions_recorded_over_records_total" {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	for _, name := range []string{"outbox_relay_publish_errors_total"} {
		for _, class := range []string{"retriable", "producer", "permanent"} {
			if _, ok := harness.MetricValue(after, name, "class", class); !ok {
				t.Errorf("/metrics lacks %s{class=%q}: alerts and dashboards need it at 0 before the first error", name, class)
			}
		}
	}
	for _, name := range []string{"go_goroutines", "go_gc_duration_seconds", "go_memstats_heap_alloc_bytes",
		"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"} {
		if after[name] == nil {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	if v, _ := harness.MetricValue(after, "outbox_relay_state", "state", "streaming"); v != 1 {
		t.Errorf("outbox_relay_state{state=streaming} = %v while streaming", v)
	}
	if v, _ := harness.MetricValue(after, "outbox_relay_state", "state", "backing-off"); v != 0 {
		t.Errorf("outbox_relay_state{state=backing-off} = %v while streaming", v)
	}

	// The slot watch reports the slot as active.
	harness.WaitFor(t, 30*time.Second, "outbox_relay_slot_active 1 and wal_status reserved", func() bool {
		f := harness.Scrape(t, base)
		active, _ := harness.MetricValue(f, "outbox_relay_slot_active")
		reserved, _ := harness.MetricValue(f, "outbox_relay_slot_wal_status", "wal_status", "reserved")
		return active == 1 && reserved == 1
	})

	// /slot: the server's view beside the relay's.
	harness.WaitFor(t, 30*time.Second, "/slot to show the acknowledged events confirmed", func() bool {
		d := getSlot(t, base)
		return d.Relay["in_flight_events"] == 0.0 && d.Relay["last_ack_time"] != nil && d.Relay["confirmed_lsn"] != ""
	})
	doc := getSlot(t, base)
	for _, key := range []string{"slot_name", "plugin", "active", "active_pid", "restart_lsn", "confirmed_flush_lsn",
		"wal_status", "safe_wal_size", "current_wal_lsn", "retained_wal_bytes", "lag_bytes"} {
		if _, ok := doc.Slot[key]; !ok {
			t.Errorf("/slot .slot has no %q: %v", key, doc.Slot)
		}
	}
	for _, key := range []string{"received_lsn", "confirmed_lsn", "in_flight_events", "in_flight_transactions",
		"oldest_in_flight_age_seconds", "last_confirmed_commit_time", "last_ack_time", "quarantined_events",
		"state", "state_since", "last_error"} {
		if _, ok := doc.Relay[key]; !ok {
			t.Errorf("/slot .relay has no %q: %v", key, doc.Relay)
		}
	}
	si := cluster.SlotInfo(t, e.DB.Name(), e.Slot)
	if doc.Slot["slot_name"] != e.Slot || doc.Slot["plugin"] != "pgoutput" || doc.Slot["active"] != true ||
		doc.Slot["active_pid"] != float64(si.ActivePID) || doc.Slot["wal_status"] != "reserved" {
		t.Errorf("/slot .slot = %v; pg_replication_slots says %+v", doc.Slot, si)
	}
	if doc.Relay["state"] != "streaming" || doc.SlotError != "" {
		t.Errorf("/slot .relay.state %v, slot_error %q", doc.Relay["state"], doc.SlotError)
	}
}

// The admin endpoint listens on loopback unless told otherwise: it is
// unauthenticated.
func TestAdminEndpointDefaultsToLoopback(t *testing.T) {
	t.Parallel()
	bin := harness.BuildRelay(t)
	p := harness.StartProcess(t, bin, []string{"run", "-h"}, nil)
	if code, err := p.Wait(time.Minute); err != nil || code != 0 {
		t.Fatalf("run -h exited %d (%v)", code, err)
	}
	m := regexp.MustCompile(`(?s)-admin-addr string.*?\(default "([^"]*)"\)`).FindStringSubmatch(p.Output())
	if m == nil {
		t.Fatalf("run -h does not show the default of --admin-addr:\n%s", p.Output())
	}
	if !strings.HasPrefix(m[1], "127.0.0.1:") {
		t.Errorf("--admin-addr defaults to %q, want a 127.0.0.1 address", m[1])
	}
}

// While Kafka does not acknowledge, the slot cannot advance: the slot
// poller's gauges show the lag and the in-flight age grow, and recover once
// Kafka answers again.
func TestSlotGaugesFollowTheSlot(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	p := e.StartRelay()
	base := p.AdminURL(t)
	harness.WaitFor(t, 30*time.Second, "the slot watch to see the slot active", func() bool {
		v, _ := harness.MetricValue(harness.Scrape(t, base), "outbox_relay_slot_active")
		return v == 1
	})

	release := e.Kafka.HoldProduce()
	ids := insert(t, e.DB.DSN(), "order", 200)
	// 200 single-row transactions write well over 50 kB of WAL.
	var peak float64
	harness.WaitFor(t, time.Minute, "slot lag, retained WAL, in-flight events and their age to grow", func() bool {
		f := harness.Scrape(t, base)
		lag, _ := harness.MetricValue(f, "outbox_relay_slot_lag_bytes")
		retained, _ := harness.MetricValue(f, "outbox_relay_slot_retained_wal_bytes")
		inFlight, _ := harness.MetricValue(f, "outbox_relay_in_flight_events")
		age, _ := harness.MetricValue(f, "outbox_relay_oldest_unpublished_event_age_seconds")
		peak = lag
		return lag > 50000 && retained >= lag && inFlight > 0 && age >= 2
	})
	doc := getSlot(t, base)
	if doc.Relay["in_flight_events"].(float64) <= 0 || doc.Relay["oldest_in_flight_age_seconds"].(float64) < 2 {
		t.Errorf("/slot .relay while Kafka holds the records: %v", doc.Relay)
	}

	release()
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, ids, time.Minute)
	// Other tests write WAL into the shared cluster meanwhile, so the lag
	// drops to what they wrote since the relay's last confirmation.
	harness.WaitFor(t, time.Minute, "the lag and in-flight gauges to drop after Kafka answered", func() bool {
		f := harness.Scrape(t, base)
		lag, _ := harness.MetricValue(f, "outbox_relay_slot_lag_bytes")
		inFlight, _ := harness.MetricValue(f, "outbox_relay_in_flight_events")
		age, _ := harness.MetricValue(f, "outbox_relay_oldest_unpublished_event_age_seconds")
		return lag < peak/2 && inFlight == 0 && age == 0
	})
}

// The stream loop must wait for the server, not spin: an idle relay runs
// beside a production database for months. An idle relay that burns a
// core is a bug (measured here before the fix: 13-15 s of CPU per 20 s).
func TestIdleRelayUsesLittleCPU(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	p := e.StartRelay()
	ids := insert(t, e.DB.DSN(), "order", 3)
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, ids, time.Minute)

	// Measure the relay's own CPU time over a wall-clock window that is
	// long enough to span its keepalive interval (10s by default). The
	// process's CPU clock counts its own work only, in nanoseconds: other
	// tests running beside it do not add to it, and a 10 ms tick cannot
	// round it either way.
	const window = 12 * time.Second
	cpu := func() float64 {
		d, err := harness.ProcessCPU(p.Pid())
		if err != nil {
			t.Fatalf("relay CPU: %v", err)
		}
		return d.Seconds()
	}
	start, startCPU := time.Now(), cpu()
	var elapsed time.Duration
	var used float64
	harness.WaitFor(t, window+30*time.Second, "the measuring window to pass", func() bool {
		elapsed = time.Since(start)
		if elapsed < window {
			return false
		}
		used = cpu() - startCPU
		return true
	})
	t.Logf("idle relay used %.2fs of CPU in %v", used, elapsed.Round(time.Millisecond))
	if limit := 0.05 * elapsed.Seconds(); used > limit {
		t.Errorf("idle relay used %.2fs of CPU in %v, more than 5%% of one core (%.2fs)", used, elapsed.Round(time.Millisecond), limit)
	}
}

// Issue 24.4: with Kafka not answering, /readyz said 200 ready for 100 s
// while the oldest in-flight age rose from 7 s to 108 s, and in
// exactly-once mode nothing was logged for 90 s. Once events wait longer
// than --kafka-stall-timeout with no acknowledgement, /readyz is 503 with
// the reason, a warning is logged at the start and again at that interval,
// and outbox_relay_kafka_stall_seconds shows it; all of it clears once
// Kafka acknowledges again.
func TestKafkaStallMakesReadyzNotReady(t *testing.T) {
	for _, delivery := range []string{"at-least-once", "exactly-once"} {
		t.Run(delivery, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.Migrate()
			// From the environment: a relay that did not know the setting
			// would still start, and the test would fail on what it does.
			p := e.start(e.Args("run", "--delivery", delivery), "OUTBOX_RELAY_KAFKA_STALL_TIMEOUT=2s")
			p.WaitForOutput(t, harness.LogStreaming, 2*time.Minute)
			base := p.AdminURL(t)
			ids := insert(t, e.DB.DSN(), "order", 2)
			harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, ids, time.Minute)
			if code, body := harness.HTTPGet(t, base+"/readyz"); code != http.StatusOK {
				t.Fatalf("/readyz before the stall: %d %q", code, body)
			}

			release := e.Kafka.HoldProduce()
			defer release()
			ids = append(ids, insert(t, e.DB.DSN(), "order", 5)...)
			var body string
			harness.WaitFor(t, 30*time.Second, "/readyz 503 naming the stall", func() bool {
				var code int
				code, body = harness.HTTPGet(t, base+"/readyz")
				return code == http.StatusServiceUnavailable && strings.Contains(body, "kafka-stalled") && strings.Contains(body, "events in flight")
			})
			// Issue 40.11: /slot said "streaming" meanwhile. One truth:
			// the same state and cause as /readyz.
			var slot struct {
				Relay struct {
					State       string     `json:"state"`
					LastError   string     `json:"last_error"`
					LastErrorAt *time.Time `json:"last_error_at"`
				} `json:"relay"`
			}
			if code, doc := harness.HTTPGet(t, base+"/slot"); code != http.StatusOK || json.Unmarshal([]byte(doc), &slot) != nil {
				t.Fatalf("/slot: %d %q", code, doc)
			}
			if slot.Relay.State != "waiting-for-kafka" || !strings.Contains(slot.Relay.LastError, "kafka-stalled") || slot.Relay.LastErrorAt == nil {
				t.Errorf("/slot during the stall: state %q, last_error %q at %v; want waiting-for-kafka and the stall as /readyz says (%q)",
					slot.Relay.State, slot.Relay.LastError, slot.Relay.LastErrorAt, body)
			}
			// The gauge is sampled once a second, /readyz at each request.
			harness.WaitFor(t, 10*time.Second, "outbox_relay_kafka_stall_seconds at 2 or more", func() bool {
				return harness.Metric(t, base, "outbox_relay_kafka_stall_seconds") >= 2
			})
			const warning = "kafka has not acknowledged any event for longer than --kafka-stall-timeout"
			harness.WaitFor(t, 30*time.Second, "the stall warning, repeated", func() bool {
				return strings.Count(p.Output(), warning) >= 2
			})

			release()
			harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, ids, 2*time.Minute)
			harness.WaitFor(t, time.Minute, "/readyz 200 after Kafka answered", func() bool {
				code, _ := harness.HTTPGet(t, base+"/readyz")
				return code == http.StatusOK
			})
			p.WaitForOutput(t, "kafka acknowledges again after a stall", 30*time.Second)
			harness.WaitFor(t, 10*time.Second, "the stall gauge back to 0", func() bool {
				return harness.Metric(t, base, "outbox_relay_kafka_stall_seconds") == 0
			})
		})
	}
}
