package drills

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillProduceQuota puts a produce quota of 20 KB/s on the relay's
// client id on Apache Kafka, under a writer committing about 100 events a
// second, for 30 s (2 min at full size), then lifts it. The brokers
// throttle every produce response; nothing may fail, be lost or reorder,
// and the relay must say it is throttled (outbox_relay_kafka_throttle_
// seconds_total grows, a warning is logged).
func TestDrillProduceQuota(t *testing.T) {
	rng := newRand(t)
	w := newWorld(t, shared, nil)
	w.topicPrefix = "drill_quota."
	k := requireKafka(t, harness.ApacheKafkaOptions{Version: harness.ApacheKafka4Version}, w.topics(), 1, nil)
	w.Brokers = k.Brokers()
	w.Migrate()
	adm := kadm.NewClient(harness.NewKgoClient(t, w.Brokers))
	clientID := "outbox-relay"
	quota := func(remove bool) {
		t.Helper()
		_, err := adm.AlterClientQuotas(context.Background(), []kadm.AlterClientQuotaEntry{{
			Entity: kadm.ClientQuotaEntity{{Type: "client-id", Name: &clientID}},
			Ops:    []kadm.AlterClientQuotaOp{{Key: "producer_byte_rate", Value: 20 << 10, Remove: remove}},
		}})
		if err != nil {
			t.Fatalf("alter the client quota: %v", err)
		}
	}
	t.Cleanup(func() { quota(true) })
	admin := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	relay := w.startRelay("--admin-addr", admin, "--progress-topic", "drill_quota_progress")
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 50*time.Millisecond, 5, 200, false)
	defer pw.halt()
	off := newOffsets(t, w.Brokers)
	harness.WaitFor(t, time.Minute, "the relay delivers events", func() bool {
		m, err := off.read(w.topics())
		return err == nil && sumOffsets(m) >= 300
	})
	before, _ := harness.MetricValue(harness.Scrape(t, "http://"+admin), "outbox_relay_kafka_throttle_seconds_total")
	m0, err := off.read(w.topics())
	if err != nil {
		t.Fatal(err)
	}
	quota(false)
	quotaFor := time.Duration(harness.Sized(30, 120)) * time.Second
	err = hold(quotaFor, func() error {
		if relay.Exited() {
			return fmt.Errorf("relay exited under a quota:\n%s", relay.Output())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	m1, err := off.read(w.topics())
	if err != nil {
		t.Fatal(err)
	}
	throttled, _ := harness.MetricValue(harness.Scrape(t, "http://"+admin), "outbox_relay_kafka_throttle_seconds_total")
	quota(true)
	if err := pw.halt(); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	if throttled-before <= 0 {
		t.Errorf("outbox_relay_kafka_throttle_seconds_total did not grow under a 20 KB/s quota (%v, then %v)", before, throttled)
	}
	if !strings.Contains(relay.Output(), "the brokers throttle the relay's Kafka requests") {
		t.Errorf("no warning that the brokers throttle the relay:\n%s", relay.Output())
	}
	dups := len(records) - len(harness.FirstDeliveries(records))
	t.Logf("%v under a 20 KB/s producer quota: %d records reached Kafka meanwhile, throttled %.1f s in all; %d events, %d records, %d duplicates, 0 lost, order kept",
		quotaFor, sumOffsets(m1)-sumOffsets(m0), throttled-before, w.CommittedCount(), len(records), dups)
}
