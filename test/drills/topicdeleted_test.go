package drills

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillEventTopicDeleted deletes an event topic under a streaming relay
// (auto-creation off) while a writer commits about 100 events a second,
// then creates it again as the relay's message says. The relay must not
// quarantine the topic's events (a replay would put them after the ones
// published once the topic was back), must say on /readyz what happened
// and what to do, and must deliver, in order, every event committed after
// the deletion once the topic exists again. Before, every event of the
// topic was quarantined meanwhile.
func TestDrillEventTopicDeleted(t *testing.T) {
	rng := newRand(t)
	w, k := kfakeWorld(t, harness.KfakeOptions{DisableAutoCreate: true})
	admin := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	relay := w.startRelay("--admin-addr", admin)
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 50*time.Millisecond, 5, 200, false)
	defer pw.halt()
	off := newOffsets(t, w.Brokers)
	harness.WaitFor(t, time.Minute, "the relay delivers events", func() bool {
		m, err := off.read(w.topics())
		return err == nil && sumOffsets(m) >= 300
	})

	topic := w.topics()[0]
	adm := kadm.NewClient(k.Client(t))
	if _, err := adm.DeleteTopics(context.Background(), topic); err != nil {
		t.Fatal(err)
	}
	deletedAt, deleted := w.CommittedCount(), time.Now()
	var notReady string
	harness.WaitFor(t, time.Minute, "/readyz says the topic was deleted", func() bool {
		code, body := harness.HTTPGet(t, "http://"+admin+"/readyz")
		notReady = body
		return relay.Exited() || code == http.StatusServiceUnavailable && strings.Contains(body, "was deleted")
	})
	if relay.Exited() {
		t.Fatalf("relay exited when its topic was deleted:\n%s", relay.Output())
	}
	noticed := time.Since(deleted)
	if _, err := adm.CreateTopic(context.Background(), partitions, 1, nil, topic); err != nil {
		t.Fatal(err)
	}
	created := time.Now()
	if err := pw.halt(); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(3 * time.Minute)
	settled := time.Since(created)
	if n := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine"); n != 0 {
		t.Errorf("%d events quarantined while their topic was deleted, want 0: a replay would reorder them", n)
	}
	// Whatever was in the topic went with it; everything committed after
	// the deletion must be in the new one, in order.
	ids, order := w.Committed()
	after := ids[deletedAt:]
	records := harness.ConsumeEventIDs(t, w.Brokers, w.topicRegex(), after, 2*time.Minute)
	harness.CheckNoLoss(t, records, after)
	kept := map[string]bool{}
	for _, id := range after {
		kept[id] = true
	}
	for agg, evs := range order {
		var left []string
		for _, id := range evs {
			if kept[id] {
				left = append(left, id)
			}
		}
		order[agg] = left
	}
	harness.CheckPerAggregateOrder(t, records, order)
	t.Logf("topic %s deleted with %d events committed; /readyz said so after %v: %q; once created again, everything settled within %v; %d events committed after the deletion all delivered in order, 0 quarantined",
		topic, deletedAt, noticed.Round(100*time.Millisecond), strings.TrimSpace(notReady)[:min(len(strings.TrimSpace(notReady)), 160)], settled.Round(100*time.Millisecond), len(after))
}
