package reconcile_test

import (
	"regexp"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// run --reconcile-every exports the missing events of its window and the
// time of its last complete check, and never republishes them.
func TestPeriodicCheckExportsMissingEvents(t *testing.T) {
	e := newEnv(t)
	e.Migrate("--skip-slot")
	lost := e.commit(3, "order") // no slot yet: never published
	e.Migrate("--existing-rows", "published")
	started := time.Now()
	relay := e.StartRelay("--admin-addr", "127.0.0.1:0",
		"--reconcile-every", "200ms", "--reconcile-window", "1h", "--reconcile-settle", "0s")
	admin := relay.AdminURL(t)
	metric := func(name string) (float64, bool) { return harness.MetricValue(harness.Scrape(t, admin), name) }
	if v, ok := metric("outbox_relay_reconcile_interval_seconds"); !ok || v != 0.2 {
		t.Fatalf("outbox_relay_reconcile_interval_seconds = %v (present %v), want 0.2", v, ok)
	}
	published := e.commit(2, "order")
	e.consumeAll(published)

	var firstCheck float64
	harness.WaitFor(t, time.Minute, "a check reports the 3 lost events", func() bool {
		missing, ok1 := metric("outbox_relay_reconcile_missing_events")
		firstCheck, _ = metric("outbox_relay_reconcile_last_complete_timestamp_seconds")
		return ok1 && missing == 3 && firstCheck >= float64(started.Unix())
	})
	harness.WaitFor(t, time.Minute, "a later check completes", func() bool {
		last, _ := metric("outbox_relay_reconcile_last_complete_timestamp_seconds")
		return last > firstCheck
	})
	if missing, _ := metric("outbox_relay_reconcile_missing_events"); missing != 3 {
		t.Fatalf("a later check reports %v missing, want still 3: the background check must not republish", missing)
	}
	// Count only this test's events: what else the topic holds is not
	// this check's business, and says nothing about a republish.
	lostIDs := map[string]bool{}
	for _, id := range lost {
		lostIDs[id] = true
	}
	copies := map[string]int{}
	for _, r := range harness.ConsumeToEnd(t, e.Kafka.Brokers(), "outbox.event.order", time.Minute) {
		copies[r.EventID()]++
	}
	var republished []string
	for _, id := range lost {
		if copies[id] > 0 {
			republished = append(republished, id)
		}
	}
	if len(republished) > 0 {
		t.Fatalf("Kafka holds the lost events %v, which only an explicit --republish may send: the background check republished them", republished)
	}
	for _, id := range published {
		if copies[id] == 0 {
			t.Fatalf("Kafka lost the published event %s after the consumer had read it", id)
		}
	}
	records, most := 0, 0
	for _, n := range copies {
		records += n
		most = max(most, n)
	}
	t.Logf("outbox.event.order holds %d records of %d distinct events (at most %d copies of one); this test's %d published ones, none of the %d lost ones",
		records, len(copies), most, len(published), len(lost))
	if !regexp.MustCompile(`"level":"error".*"first_missing":\[[^\]]*` + lost[0]).MatchString(relay.Output()) {
		t.Fatalf("the relay's log does not name the missing event %s:\n%s", lost[0], relay.Output())
	}
}
