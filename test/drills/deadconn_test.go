package drills

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// logSilent is what the relay logs when it takes its replication
// connection for dead.
const logSilent = "replication connection silent"

// TestDrillPostgresBlackHole black-holes every connection between the
// relay and PostgreSQL (no FIN, no RST: toxiproxy drops everything both
// ways and passes no close on) while a writer commits about 100 events a
// second, in both delivery modes. The relay must notice within its bound
// (max(--pg-timeout, wal_sender_timeout)), connect again once the network
// lets it, and lose nothing; read_committed readers see each event once.
// On the relay before the bound existed it stayed alive and published
// nothing more, for ever.
func TestDrillPostgresBlackHole(t *testing.T) {
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) {
			const senderTimeout = 10 * time.Second
			pg := harness.StartPostgres(t, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "10s"}})
			rng := newRand(t)
			w, _ := newKfakeWorld(t, pg)
			toxi := harness.StartToxi(t, fmt.Sprintf("127.0.0.1:%d", pg.Port()))
			w.relayDSN = strings.Replace(w.DB.DSN(), fmt.Sprintf("127.0.0.1:%d", pg.Port()), toxi.Addr(), 1)
			if w.relayDSN == w.DB.DSN() {
				t.Fatalf("could not point the DSN %s at the proxy", w.DB.DSN())
			}
			off := newOffsets(t, w.Brokers)
			flags := []string{"--pg-timeout", "5s"}
			if mode == "exactly-once" {
				flags = append(flags, eosFlags...)
			}
			relay := w.startRelay(flags...)
			conn := w.connect()
			pw := startPacedWriter(w, conn, writerRand(rng), 50*time.Millisecond, 5, 200, false)
			defer pw.halt()
			harness.WaitFor(t, time.Minute, "the relay delivers events", func() bool {
				m, err := off.read(w.topics())
				return err == nil && sumOffsets(m) >= 300
			})

			streams := strings.Count(relay.Output(), harness.LogStreaming)
			toxi.BlackHole(t)
			holed := time.Now()
			harness.WaitFor(t, 4*senderTimeout, "the relay notices its dead replication connection", func() bool {
				return relay.Exited() || strings.Contains(relay.Output(), logSilent)
			})
			if relay.Exited() {
				t.Fatalf("relay exited behind the black hole:\n%s", relay.Output())
			}
			detected := time.Since(holed)
			toxi.Heal(t)
			healed := time.Now()
			harness.WaitFor(t, 2*time.Minute, "the relay streams again", func() bool {
				return relay.Exited() || strings.Count(relay.Output(), harness.LogStreaming) > streams
			})
			if relay.Exited() {
				t.Fatalf("relay exited after the black hole:\n%s", relay.Output())
			}
			again := time.Since(healed)
			if detected > 2*senderTimeout {
				t.Errorf("the dead connection was noticed after %v, want within about wal_sender_timeout (%v)", detected, senderTimeout)
			}
			if err := pw.halt(); err != nil {
				t.Fatal(err)
			}
			var records []harness.Record
			dups := 0
			if mode == "exactly-once" {
				records = w.settleExactlyOnce(3 * time.Minute)
			} else {
				records = w.waitSettled(3 * time.Minute)
				w.checkDelivery(records)
				dups = len(records) - len(harness.FirstDeliveries(records))
			}
			t.Logf("%s: black hole noticed after %v, streaming again %v after the network healed; %d events, %d records, %d duplicates, 0 lost, order kept",
				mode, detected.Round(100*time.Millisecond), again.Round(100*time.Millisecond), w.CommittedCount(), len(records), dups)
		})
	}
}
