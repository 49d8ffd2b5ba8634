package drills

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillBrokerRefusesForMinutes has the broker answer every produce
// request to the event topics with NOT_ENOUGH_REPLICAS (an ISR short of
// min.insync.replicas) for longer than the producer's retry budget, while
// a writer commits about 100 events a second, in each delivery mode. The
// relay must say so where an operator looks, /readyz 503 naming the stall
// and the stall gauge growing, never exit, never confirm past what Kafka
// did not take, and deliver everything once the broker accepts again.
//
// Reduced: 40 s of refusals; OUTBOX_RELAY_DRILL_SIZE=full: 3 minutes.
func TestDrillBrokerRefusesForMinutes(t *testing.T) {
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) {
			rng := newRand(t)
			w, k := kfakeWorld(t, harness.KfakeOptions{})
			admin := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
			relay, pw, _ := w.underLoad(rng, mode == "exactly-once", 200, "--admin-addr", admin, "--kafka-stall-timeout", "5s")

			refuseFor := time.Duration(harness.Sized(40, 180)) * time.Second
			fault := k.FailProduceTo(w.topicPrefix, -1, kerr.NotEnoughReplicas.Code)
			fence := w.fence(w.connect(), w.genEvents(rng, 5, 200)) // its own connection: the writer has one
			var notReady string
			var maxStall float64
			slotSaid := false
			err := hold(refuseFor, func() error {
				if relay.Exited() {
					return fmt.Errorf("relay exited while the broker refused:\n%s", relay.Output())
				}
				if c := w.ConfirmedFlush(); !notPast(c, fence) {
					return fmt.Errorf("confirmed_flush_lsn %s passed an event Kafka refused (commit at %s)", c, fence)
				}
				if code, body := harness.HTTPGet(t, "http://"+admin+"/readyz"); code == http.StatusServiceUnavailable && notReady == "" {
					notReady = body
				}
				var slot struct {
					Relay struct {
						State     string `json:"state"`
						LastError string `json:"last_error"`
					} `json:"relay"`
				}
				if _, body := harness.HTTPGet(t, "http://"+admin+"/slot"); json.Unmarshal([]byte(body), &slot) == nil &&
					slot.Relay.State == "waiting-for-kafka" && strings.Contains(slot.Relay.LastError, "kafka-stalled") {
					slotSaid = true
				}
				if v, ok := harness.MetricValue(harness.Scrape(t, "http://"+admin), "outbox_relay_kafka_stall_seconds"); ok {
					maxStall = max(maxStall, v)
				}
				return nil
			})
			refused := fault.Hits()
			fault.Remove()
			healed := time.Now()
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(notReady, "kafka-stalled") {
				t.Errorf("/readyz never said the relay waits for Kafka during %v of refusals; last not-ready body %q", refuseFor, notReady)
			}
			if !slotSaid {
				t.Errorf("/slot never said waiting-for-kafka with the stall during %v of refusals", refuseFor)
			}
			if maxStall < 5 {
				t.Errorf("outbox_relay_kafka_stall_seconds peaked at %v during %v of refusals, want it past the stall timeout", maxStall, refuseFor)
			}
			harness.WaitFor(t, 2*time.Minute, "the fence event's commit is confirmed", func() bool {
				return !notPast(w.ConfirmedFlush(), fence)
			})
			drained := time.Since(healed)
			if err := pw.halt(); err != nil {
				t.Fatal(err)
			}
			records, dups := w.settle(mode == "exactly-once", 3*time.Minute)
			t.Logf("%s: %v of NOT_ENOUGH_REPLICAS (%d produce requests refused), /readyz %q, stall gauge peaked at %.0f s; refusals' start confirmed %v after they ended; %d events, %d records, %d duplicates, 0 lost, order kept",
				mode, refuseFor, refused, strings.TrimSpace(notReady), maxStall, drained.Round(100*time.Millisecond), w.CommittedCount(), len(records), dups)
		})
	}
}
