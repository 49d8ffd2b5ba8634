package reconcile_test

import (
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// metric reads one unlabelled series from the relay's /metrics; ok is
// false when it is absent or the endpoint does not answer.
func metric(admin, name string) (float64, bool) {
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, false
	}
	m := regexp.MustCompile(`(?m)^` + name + ` (\S+)$`).FindSubmatch(body)
	if m == nil {
		return 0, false
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	return v, err == nil
}

// run --reconcile-every exports the missing events of its window and the
// time of its last complete check, and never republishes them.
func TestPeriodicCheckExportsMissingEvents(t *testing.T) {
	e := newEnv(t)
	e.migrate("--skip-slot")
	lost := e.commit(3, "order") // no slot yet: never published
	e.migrate()
	admin := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	started := time.Now()
	relay := harness.StartProcess(t, e.bin, e.command("run", "--admin-addr", admin,
		"--reconcile-every", "200ms", "--reconcile-window", "1h", "--reconcile-settle", "0s"), nil)
	relay.WaitForOutput(t, `"message":"streaming"`, time.Minute)
	if v, ok := metric(admin, "outbox_relay_reconcile_interval_seconds"); !ok || v != 0.2 {
		t.Fatalf("outbox_relay_reconcile_interval_seconds = %v (present %v), want 0.2", v, ok)
	}
	published := e.commit(2, "order")
	e.consumeAll(published)

	var firstCheck float64
	harness.WaitFor(t, time.Minute, "a check reports the 3 lost events", func() bool {
		missing, ok1 := metric(admin, "outbox_relay_reconcile_missing_events")
		firstCheck, _ = metric(admin, "outbox_relay_reconcile_last_complete_timestamp_seconds")
		return ok1 && missing == 3 && firstCheck >= float64(started.Unix())
	})
	harness.WaitFor(t, time.Minute, "a later check completes", func() bool {
		last, _ := metric(admin, "outbox_relay_reconcile_last_complete_timestamp_seconds")
		return last > firstCheck
	})
	if missing, _ := metric(admin, "outbox_relay_reconcile_missing_events"); missing != 3 {
		t.Fatalf("a later check reports %v missing, want still 3: the background check must not republish", missing)
	}
	var records int64
	for _, end := range harness.EndOffsets(t, e.kafka.Brokers(), "outbox.event.order") {
		records += end
	}
	if records != int64(len(published)) {
		t.Fatalf("Kafka holds %d records, want the %d published ones: the lost events %v were republished", records, len(published), lost)
	}
	if !regexp.MustCompile(`"level":"error".*"first_missing":\[[^\]]*` + lost[0]).MatchString(relay.Output()) {
		t.Fatalf("the relay's log does not name the missing event %s:\n%s", lost[0], relay.Output())
	}
}
