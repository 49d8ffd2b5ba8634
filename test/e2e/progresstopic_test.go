package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Issue 24.1: `run --topic same.topic --progress-topic same.topic` created
// same.topic compacted with one partition and wrote events and progress
// records into it, so compaction would keep one event per aggregate; and
// --progress-topic outbox.event.pub, a name the default template makes for
// aggregate_type "pub", was accepted. A progress topic the topic template
// can name is refused with exit 2 before anything is written.
func TestProgressTopicTheTemplateCanNameIsRefused(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	conn := e.DB.Connect(t)
	if err := e.writeEvents(conn, 3, 1, 3); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ topic, progress string }{
		{"same.topic", "same.topic"},
		{"outbox.event.{aggregate_type}", "outbox.event.pub"},
		{"{aggregate_type}.events", "outbox.events"},
	} {
		p := e.StartRelayNoWait("--topic", tc.topic, "--progress-topic", tc.progress)
		code, err := p.Wait(30 * time.Second)
		if err != nil {
			p.Kill()
			t.Fatalf("--topic %s --progress-topic %s: %v; output tail:\n%s", tc.topic, tc.progress, err, harness.LastLines(p.Output(), 20))
		}
		if code != 2 || !outputHas(p.Output(), "--progress-topic "+tc.progress, "--topic "+tc.topic+" can name it") {
			t.Errorf("--topic %s --progress-topic %s: exit %d, want 2 naming both flags:\n%s", tc.topic, tc.progress, code, p.Output())
		}
		if exists, n := harness.TopicRecords(t, e.Kafka.Brokers(), tc.progress); exists {
			t.Errorf("%s exists with %d records after the refused start", tc.progress, n)
		}
	}
}

// Issue 24.1: an existing --progress-topic with 3 partitions and
// cleanup.policy=delete (an event topic, say) was used without a check,
// and its consumers got progress records with no event_id. The relay now
// stops at start with the reason and the fix, and writes nothing into it.
func TestExistingProgressTopicMustBeCompactedWithOnePartition(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	const business = "billing.ledger"
	e.Kafka.CreateTopic(t, business, 3, map[string]string{"cleanup.policy": "delete"})
	conn := e.DB.Connect(t)
	if err := e.writeEvents(conn, 3, 1, 3); err != nil {
		t.Fatal(err)
	}
	p := e.StartRelayNoWait("--progress-topic", business)
	code, err := p.Wait(60 * time.Second)
	if err != nil {
		p.Kill()
		t.Fatalf("relay with --progress-topic %s: %v; output tail:\n%s", business, err, harness.LastLines(p.Output(), 20))
	}
	out := p.Output()
	if code != 1 || !outputHas(out, business, "3 partitions, not 1", `cleanup.policy is \"delete\", not compact`, "--progress-topic", "kafka-topics.sh") {
		t.Errorf("exit %d, want 1 with the reason and the fix:\n%s", code, out)
	}
	if _, n := harness.TopicRecords(t, e.Kafka.Brokers(), business); n != 0 {
		t.Errorf("%s holds %d records after the relay refused it", business, n)
	}
	if strings.Contains(out, harness.LogStreaming) {
		t.Errorf("the relay streamed with an unusable progress topic:\n%s", out)
	}
}
