package drills

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillQuarantineWriteOnSlowLink sends an event too large for Kafka
// over a slow but live PostgreSQL link (100 ms ± 50 ms of latency and
// 32 KB/s from the relay to PostgreSQL): its record exceeds
// --kafka-max-message-bytes, so it goes to the quarantine table, a 1 MB
// write that takes about 33 s over that link. The relay must store it and
// go on; before, the write had 30 s whatever its size, failed, and the
// relay exited 1 with advice that, followed, failed the same way.
func TestDrillQuarantineWriteOnSlowLink(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{})
	w, _ := newKfakeWorld(t, pg)
	toxi := harness.StartToxi(t, fmt.Sprintf("127.0.0.1:%d", pg.Port()))
	w.relayDSN = strings.Replace(w.DB.DSN(), fmt.Sprintf("127.0.0.1:%d", pg.Port()), toxi.Addr(), 1)
	if w.relayDSN == w.DB.DSN() {
		t.Fatalf("could not point the DSN %s at the proxy", w.DB.DSN())
	}
	relay := w.startRelay("--pg-timeout", "5s", "--kafka-max-message-bytes", "500000")
	conn := w.connect()
	const size = 1_000_000
	big := harness.NumberedEvent(0, 0, `{"pad": "`+strings.Repeat("x", size)+`"}`)
	if err := w.Commit(context.Background(), conn, []harness.OutboxEvent{big}); err != nil {
		t.Fatal(err)
	}
	bigID, _ := w.Committed()
	// Only what the relay sends is slowed: the WAL it reads comes at full
	// speed, so the drill's time is the write's.
	toxi.SlowUpstream(t, 100, 50, 32)
	start := time.Now()
	table := "outbox_quarantine"
	harness.WaitFor(t, 5*time.Minute, "the oversize event in the quarantine table, or the relay's exit", func() bool {
		return relay.Exited() || w.DB.QueryInt64(t, "SELECT count(*) FROM "+table+" WHERE event_id = $1", bigID[0]) > 0
	})
	took := time.Since(start)
	if relay.Exited() {
		t.Fatalf("the relay exited after %v instead of storing the event over a slow link:\n%s", took.Round(time.Second), harness.LastLines(relay.Output(), 10))
	}
	toxi.Heal(t)
	if err := w.writeTxns(conn, newRand(t), 20, 5, 10); err != nil {
		t.Fatal(err)
	}
	ids, _ := w.Committed()
	records := harness.ConsumeEventIDs(t, w.Brokers, w.topicRegex(), ids[1:], 2*time.Minute)
	harness.CheckNoLoss(t, records, ids[1:])
	t.Logf("a %d-byte payload's quarantine write over 32 KB/s took %v; the relay went on: %d later events delivered, %d records",
		size, took.Round(time.Second), len(ids)-1, len(records))
}
