package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Issue 30: migrate published a partitioned outbox table without
// publish_via_partition_root, then failed with "publication does not
// include table" and suggested an ALTER PUBLICATION ... ADD TABLE that
// PostgreSQL refuses. migrate now publishes it through its root, events
// from every partition reach Kafka (read back with the independent
// client), and run refuses a publication without the setting, naming the
// ALTER PUBLICATION that sets it.
func TestPartitionedOutbox(t *testing.T) {
	e := newEnv(t)
	e.DB.Exec(t, harness.PartitionedOutboxSQL)
	e.Migrate()
	if v := e.DB.QueryString(t, "SELECT pubviaroot::text FROM pg_publication WHERE pubname = 'outbox_relay'"); v != "true" {
		t.Fatalf("migrate made the publication with publish_via_partition_root = %s", v)
	}
	p := e.StartRelay()
	ids := harness.InsertIntoPartitions(t, e.DB, "order")
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.order$`, ids, time.Minute)
	for _, r := range records {
		if r.Topic != "outbox.event.order" {
			t.Errorf("event %s went to topic %s", r.Headers["event_id"], r.Topic)
		}
	}
	if code, err := p.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("SIGTERM: exit %d (%v)", code, err)
	}

	e.DB.Exec(t, "ALTER PUBLICATION outbox_relay SET (publish_via_partition_root = false)")
	q := e.StartRelayNoWait()
	code, err := q.Wait(30 * time.Second)
	if err != nil {
		q.Kill()
		t.Fatalf("run with a publication that names the partitions is still running after 30 s")
	}
	const want = `ALTER PUBLICATION \"outbox_relay\" SET (publish_via_partition_root = true)`
	if code != 1 || !strings.Contains(q.Output(), want) {
		t.Fatalf("run with publish_via_partition_root off: exit %d, want 1 naming %s:\n%s", code, want, harness.LastLines(q.Output(), 5))
	}
}
