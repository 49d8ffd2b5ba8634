package drills

import (
	"fmt"
	mrand "math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// logSilent is what the relay logs when it takes its replication
// connection for dead.
const logSilent = "replication connection silent"

// settle waits until the slot confirmed everything committed and checks
// what Kafka holds: in exactly-once mode every event once for
// read_committed readers; else no loss and order, with the duplicates
// counted.
func (w *world) settle(exactlyOnce bool, timeout time.Duration) (records []harness.Record, dups int) {
	w.T.Helper()
	if exactlyOnce {
		return w.settleExactlyOnce(timeout), 0
	}
	records = w.waitSettled(timeout)
	w.checkDelivery(records)
	return records, len(records) - len(harness.FirstDeliveries(records))
}

// underLoad starts the relay with flags, in exactly-once mode when asked,
// and a writer committing 5 events over 200 aggregates every 50 ms (about
// 100 a second) until halted, and waits until Kafka holds atLeast records.
func (w *world) underLoad(rng *mrand.Rand, exactlyOnce bool, atLeast int64, flags ...string) (*harness.Process, *pacedWriter, *offsets) {
	w.T.Helper()
	off := newOffsets(w.T, w.Brokers)
	if exactlyOnce {
		flags = append(flags, eosFlags...)
	}
	relay := w.startRelay(flags...)
	pw := startPacedWriter(w, w.connect(), writerRand(rng), 50*time.Millisecond, 5, 200, false)
	w.T.Cleanup(func() { pw.halt() })
	harness.WaitFor(w.T, time.Minute, "the relay delivers events", func() bool {
		m, err := off.read(w.topics())
		return err == nil && sumOffsets(m) >= atLeast
	})
	return relay, pw, off
}

// relayThrough points the relay's DSN at proxy instead of pg.
func (w *world) relayThrough(pg *harness.Postgres, proxy *harness.Toxi) {
	w.T.Helper()
	direct := fmt.Sprintf("127.0.0.1:%d", pg.Port())
	w.relayDSN = strings.Replace(w.DB.DSN(), direct, proxy.Addr(), 1)
	if w.relayDSN == w.DB.DSN() {
		w.T.Fatalf("could not point the DSN %s at the proxy", w.DB.DSN())
	}
}

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
			w.relayThrough(pg, toxi)
			relay, pw, _ := w.underLoad(rng, mode == "exactly-once", 300, "--pg-timeout", "5s")

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
			records, dups := w.settle(mode == "exactly-once", 3*time.Minute)
			t.Logf("%s: black hole noticed after %v, streaming again %v after the network healed; %d events, %d records, %d duplicates, 0 lost, order kept",
				mode, detected.Round(100*time.Millisecond), again.Round(100*time.Millisecond), w.CommittedCount(), len(records), dups)
		})
	}
}

// logKafkaFailed is what the relay logs when its producer fails and it
// waits for Kafka with the replication connection kept.
const logKafkaFailed = "kafka failed; keeping the replication connection"

// logKafkaStalled is what the relay logs when Kafka acknowledged nothing
// for --kafka-stall-timeout; /readyz says not ready from then on.
const logKafkaStalled = "kafka has not acknowledged any event for longer than --kafka-stall-timeout"

// TestDrillKafkaBlackHole black-holes every connection between the relay
// and an Apache Kafka broker (toxiproxy in front of the broker, whose
// client listener advertises the proxy's address, so clients never go
// around it) while a writer commits about 100 events a second, in both
// delivery modes. The relay must notice within about --kafka-timeout, keep
// its replication connection, connect again once the network heals, and
// lose nothing; read_committed readers see each event once.
func TestDrillKafkaBlackHole(t *testing.T) {
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) {
			const kafkaTimeout = 5 * time.Second
			rng := newRand(t)
			w := newWorld(t, shared, nil)
			w.topicPrefix = "drill_kbh_" + strings.ReplaceAll(mode, "-", "_") + "."
			k := requireKafka(t, harness.ApacheKafkaOptions{Version: harness.ApacheKafka4Version, Proxied: true}, w.topics(), 1, nil)
			toxi := k.Toxi(0)
			t.Cleanup(func() { toxi.Heal(t) })
			w.Brokers = k.Brokers()
			w.Migrate()
			relay, pw, off := w.underLoad(rng, mode == "exactly-once", 300, "--kafka-timeout", kafkaTimeout.String(),
				"--kafka-stall-timeout", (2 * kafkaTimeout).String(), "--progress-topic", "drill_kbh_progress_"+strings.ReplaceAll(mode, "-", "_"))

			failed := strings.Count(relay.Output(), logKafkaFailed)
			stalled := strings.Count(relay.Output(), logKafkaStalled)
			toxi.BlackHole(t)
			holed := time.Now()
			// At least once, the black hole lasts until the producer gives up
			// on a record, the case where sarama went on with the records
			// queued behind it; exactly once, the transaction waits without
			// failing, and the stall is what the relay notices.
			harness.WaitFor(t, 12*kafkaTimeout, "the relay notices its dead Kafka connections", func() bool {
				out := relay.Output()
				if mode == "exactly-once" {
					return relay.Exited() || strings.Count(out, logKafkaStalled) > stalled
				}
				return relay.Exited() || strings.Count(out, logKafkaFailed) > failed
			})
			if relay.Exited() {
				t.Fatalf("relay exited behind the black hole:\n%s", relay.Output())
			}
			detected := time.Since(holed)
			toxi.Heal(t)
			healed := time.Now()
			m, err := off.read(w.topics())
			if err != nil {
				t.Fatal(err)
			}
			harness.WaitFor(t, 2*time.Minute, "the relay delivers again", func() bool {
				now, err := off.read(w.topics())
				return relay.Exited() || err == nil && sumOffsets(now) >= sumOffsets(m)+200
			})
			if relay.Exited() {
				t.Fatalf("relay exited after the black hole:\n%s", relay.Output())
			}
			again := time.Since(healed)
			if err := pw.halt(); err != nil {
				t.Fatal(err)
			}
			records, dups := w.settle(mode == "exactly-once", 3*time.Minute)
			t.Logf("%s on Apache Kafka: black hole noticed after %v (--kafka-timeout %v), delivering again %v after the network healed; %d events, %d records, %d duplicates, 0 lost, order kept",
				mode, detected.Round(100*time.Millisecond), kafkaTimeout, again.Round(100*time.Millisecond), w.CommittedCount(), len(records), dups)
		})
	}
}
