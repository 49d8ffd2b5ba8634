package drills

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillRecordTooSlowForTheLink commits one event of about 600 KB
// (random, so compression cannot shrink it) among a writer's small ones
// while the Kafka link carries 32 KB/s, with --kafka-timeout 5s: the
// record needs about 19 s to upload, four times one request's timeout.
// Before, the producer timed out, sent it again, and looped for as long
// as the link stayed slow, the link saturated by its own retries and
// nothing behind the record delivered. A request is now given time by its
// size (tcpdial.Paced): the record crosses once, with no retry, and
// nothing is lost or reordered.
func TestDrillRecordTooSlowForTheLink(t *testing.T) {
	rng := newRand(t)
	w := newWorld(t, shared, nil)
	cluster, toxi := kfakeBehindToxi(t, w.topics())
	w.Brokers = cluster.ListenAddrs()
	w.Migrate()
	admin := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	relay := w.startRelay("--kafka-timeout", "5s", "--admin-addr", admin)
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 100*time.Millisecond, 2, 100, false)
	defer pw.halt()
	off := newOffsets(t, w.Brokers)
	harness.WaitFor(t, time.Minute, "the relay delivers events", func() bool {
		m, err := off.read(w.topics())
		return err == nil && sumOffsets(m) >= 50
	})

	toxi.Slow(t, 0, 0, 32)
	raw := make([]byte, 300_000)
	rand.Read(raw)
	big := harness.OutboxEvent{AggregateType: w.types[0], AggregateID: "big-1", EventType: "Big",
		Payload: fmt.Sprintf(`{"blob": %q}`, hex.EncodeToString(raw))}
	fence := w.fence(w.connect(), []harness.OutboxEvent{big}) // its own connection: the writer uses conn
	committed := time.Now()
	harness.WaitFor(t, 3*time.Minute, "the large record reaches Kafka", func() bool {
		if relay.Exited() {
			t.Fatalf("relay exited:\n%s", relay.Output())
		}
		return !notPast(w.ConfirmedFlush(), fence)
	})
	crossed := time.Since(committed)
	retries, _ := harness.MetricValue(harness.Scrape(t, "http://"+admin), "outbox_relay_producer_retries_total")
	toxi.Heal(t)
	if err := pw.halt(); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	restarts := strings.Count(relay.Output(), msgRestart)
	if retries > 0 || restarts > 0 {
		t.Errorf("the large record took %v producer retries and %d stream restarts, want it sent once", retries, restarts)
	}
	t.Logf("a 600 KB record over a 32 KB/s link with --kafka-timeout 5s: in Kafka %v after its commit, %v producer retries, %d stream restarts; %d events, %d records, 0 lost, order kept",
		crossed.Round(100*time.Millisecond), retries, restarts, w.CommittedCount(), len(records))
}
