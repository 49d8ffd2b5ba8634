package ops

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// `outbox-relay status` reads the slot straight from PostgreSQL: it needs
// no running relay, and says what to do when the slot is missing.
func TestStatusCommand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)

	code, out := e.run(e.Args("status"))
	if code == 0 || !strings.Contains(out, "does not exist") || !strings.Contains(out, "outbox-relay migrate") {
		t.Errorf("status of a missing slot exited %d:\n%s\nwant non-zero and advice to run migrate", code, out)
	}

	e.Migrate()
	statusJSON := func() map[string]any {
		t.Helper()
		code, out := e.run(e.Args("status"))
		if code != 0 {
			t.Fatalf("status exited %d:\n%s", code, out)
		}
		var doc map[string]any
		if err := json.Unmarshal([]byte(out), &doc); err != nil {
			t.Fatalf("status printed no JSON (%v):\n%s", err, out)
		}
		return doc
	}
	doc := statusJSON()
	si := cluster.SlotInfo(t, e.DB.Name(), e.Slot)
	want := map[string]any{"slot_name": e.Slot, "plugin": "pgoutput", "database": e.DB.Name(), "active": false,
		"active_pid": nil, "confirmed_flush_lsn": si.ConfirmedFlush, "restart_lsn": si.RestartLSN, "wal_status": "reserved"}
	for k, v := range want {
		if doc[k] != v {
			t.Errorf("status .%s = %v, want %v", k, doc[k], v)
		}
	}
	for _, k := range []string{"current_wal_lsn", "retained_wal_bytes", "lag_bytes", "safe_wal_size"} {
		if _, ok := doc[k]; !ok {
			t.Errorf("status has no %q: %v", k, doc)
		}
	}

	// With a relay streaming, status shows the slot active and its pid.
	p := e.StartRelay()
	defer p.Kill()
	doc = statusJSON()
	si = cluster.SlotInfo(t, e.DB.Name(), e.Slot)
	if doc["active"] != true || doc["active_pid"] != float64(si.ActivePID) {
		t.Errorf("status with a relay streaming: active %v pid %v; pg_replication_slots: %+v", doc["active"], doc["active_pid"], si)
	}
}

// In exactly-once mode the three places an operator looks (status, /slot
// and the metrics) show the mode and the last committed progress, and
// /slot and the metrics the Kafka transactions committed. status reads the
// progress record back with read_committed: it is committed in the same
// Kafka transaction as the events it covers, so it must reach past the
// last transaction written here.
func TestStatusSlotAndMetricsShowExactlyOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	p := e.StartRelay("--delivery", "exactly-once", "--transaction-interval", "20ms")
	base := p.AdminURL(t)
	// Once, under a full CI run, an event stayed invisible to read_committed
	// for the whole minute, with nothing in the relay's log; 880 runs under
	// load did not repeat it. Should it come back, say what the relay held:
	// its in-flight events and the Kafka transactions it committed and
	// aborted. This runs before the harness kills the relay.
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		_, slot := harness.HTTPGet(t, base+"/slot")
		t.Logf("/slot at the failure:\n%s", slot)
		_, metrics := harness.HTTPGet(t, base+"/metrics")
		for _, line := range strings.Split(metrics, "\n") {
			if strings.HasPrefix(line, "outbox_relay_kafka_transactions") || strings.HasPrefix(line, "outbox_relay_in_flight") || strings.HasPrefix(line, "outbox_relay_progress") {
				t.Log(line)
			}
		}
	})
	ids := insert(t, e.DB.DSN(), "order", 3)
	before := e.DB.CurrentLSN(t)
	ids = append(ids, insert(t, e.DB.DSN(), "order", 1)...)
	harness.ConsumeEventIDs(t, e.Brokers, topics, ids, time.Minute)

	statusArgs := e.Args("status", "--delivery", "exactly-once", "--kafka-brokers", strings.Join(e.Brokers, ","))
	var doc struct {
		Delivery string `json:"delivery"`
		Progress struct {
			LSN       string `json:"lsn"`
			WrittenBy string `json:"written_by_delivery"`
		} `json:"progress"`
	}
	var out string
	harness.WaitFor(t, time.Minute, "status shows progress past "+before, func() bool {
		var code int
		code, out = e.run(statusArgs)
		start := strings.Index(out, "{")
		return code == 0 && start >= 0 && json.Unmarshal([]byte(out[start:]), &doc) == nil &&
			doc.Progress.LSN != before && harness.LSNAtMost(before, doc.Progress.LSN)
	})
	if doc.Delivery != "exactly-once" || doc.Progress.WrittenBy != "exactly-once" {
		t.Errorf("status shows delivery %q, progress written by %q; want exactly-once for both:\n%s", doc.Delivery, doc.Progress.WrittenBy, out)
	}
	if code, out := e.run(e.Args("status")); code != 0 || !strings.Contains(out, `"delivery": "at-least-once"`) {
		t.Errorf("status without --delivery exited %d; want the default mode, at-least-once:\n%s", code, out)
	}
	if code, out := e.run(e.Args("status", "--delivery", "exactly-twice")); code != 2 || !strings.Contains(out, "--delivery") {
		t.Errorf("status --delivery exactly-twice exited %d; want 2 and the flag named:\n%s", code, out)
	}

	var slot struct {
		Relay struct {
			Delivery struct {
				Mode      string `json:"mode"`
				Committed uint64 `json:"kafka_transactions_committed"`
			} `json:"delivery"`
			Progress struct {
				LSN string `json:"lsn"`
			} `json:"progress"`
		} `json:"relay"`
	}
	// Kafka shows a commit before the relay has taken the commit's result
	// and noted the progress it carried: wait for /slot to show it.
	var body string
	shows := func() bool {
		var code int
		code, body = harness.HTTPGet(t, base+"/slot")
		if code != 200 || json.Unmarshal([]byte(body), &slot) != nil {
			return false
		}
		d := slot.Relay.Delivery
		return d.Mode == "exactly-once" && d.Committed > 0 && harness.LSNAtMost(doc.Progress.LSN, slot.Relay.Progress.LSN)
	}
	if !harness.Poll(30*time.Second, shows) {
		t.Errorf("/slot shows delivery %+v, progress %s; want exactly-once, transactions committed, progress at or past %s:\n%s",
			slot.Relay.Delivery, slot.Relay.Progress.LSN, doc.Progress.LSN, body)
	}

	m := harness.Scrape(t, base)
	if v, _ := harness.MetricValue(m, "outbox_relay_delivery_mode", "mode", "exactly-once"); v != 1 {
		t.Errorf("outbox_relay_delivery_mode{mode=exactly-once} = %v, want 1", v)
	}
	if v, _ := harness.MetricValue(m, "outbox_relay_delivery_mode", "mode", "at-least-once"); v != 0 {
		t.Errorf("outbox_relay_delivery_mode{mode=at-least-once} = %v, want 0", v)
	}
	if v, _ := harness.MetricValue(m, "outbox_relay_kafka_transactions_total", "result", "committed"); v < 1 {
		t.Errorf("outbox_relay_kafka_transactions_total{result=committed} = %v, want at least 1", v)
	}
	if _, ok := harness.MetricValue(m, "outbox_relay_kafka_transactions_total", "result", "aborted"); !ok {
		t.Errorf("/metrics lacks outbox_relay_kafka_transactions_total{result=aborted}")
	}
	if v, _ := harness.MetricValue(m, "outbox_relay_progress_lsn"); v == 0 {
		t.Errorf("outbox_relay_progress_lsn is 0 after a commit")
	}
}

// At least once, the progress writer stores the confirmed position in
// Kafka on a goroutine of its own and settles what it stored itself, where
// it was carried back through the read loop before: /slot and the metrics
// show a position written past the last commit, and when.
func TestSlotAndMetricsShowAtLeastOnceProgressWritten(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	p := e.StartRelay("--status-interval", "100ms")
	base := p.AdminURL(t)
	ids := insert(t, e.DB.DSN(), "order", 3)
	before := e.DB.CurrentLSN(t)
	harness.ConsumeEventIDs(t, e.Brokers, topics, ids, time.Minute)

	var slot struct {
		Relay struct {
			Progress struct {
				LSN       string     `json:"lsn"`
				WrittenAt *time.Time `json:"written_at"`
			} `json:"progress"`
		} `json:"relay"`
	}
	var body string
	harness.WaitFor(t, time.Minute, "/slot shows progress written past "+before, func() bool {
		var code int
		code, body = harness.HTTPGet(t, base+"/slot")
		return code == 200 && json.Unmarshal([]byte(body), &slot) == nil && slot.Relay.Progress.WrittenAt != nil &&
			harness.LSNAtMost(before, slot.Relay.Progress.LSN)
	})
	if v, _ := harness.MetricValue(harness.Scrape(t, base), "outbox_relay_progress_lsn"); v == 0 {
		t.Errorf("outbox_relay_progress_lsn is 0 while /slot shows progress %s written:\n%s", slot.Relay.Progress.LSN, body)
	}
}
