package reconcile_test

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Topics written by an exactly-once relay end in a commit marker on every
// partition, and no consumer is handed a marker: reconcile used to wait for
// the offset below the high watermark until --stall-timeout, then fail. It
// must step over markers, finish, and find everything. The record of an
// aborted transaction, carrying an event id with no row, must not count:
// read_committed consumers never see it, so it is no phantom.
func TestExactlyOnceTopicsReconcile(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	e.StartRelay("--delivery", "exactly-once", "--transaction-interval", "20ms")
	ids := append(e.commit(6, "order"), e.commit(4, "customer")...)
	e.consumeAll(ids)

	aborted := harness.NewUUID()
	cl := e.Kafka.Client(t, kgo.TransactionalID("reconcile-test-aborted"))
	ctx := context.Background()
	if err := cl.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "outbox.event.order", Key: []byte("order-1"), Value: []byte(`{}`),
		Headers: []kgo.RecordHeader{{Key: "event_id", Value: []byte(aborted)}}}).FirstErr(); err != nil {
		t.Fatalf("produce in a transaction: %v", err)
	}
	if err := cl.EndTransaction(ctx, kgo.TryAbort); err != nil {
		t.Fatalf("abort: %v", err)
	}
	// More through the relay, so the order topic ends in its commit
	// markers after the abort.
	ids = append(ids, e.commit(6, "order")...)
	records := e.consumeAll(ids)

	// The precondition: each partition the relay wrote ends in a marker,
	// past the last record a consumer reads.
	last := map[string]map[int32]int64{}
	for _, r := range records {
		if last[r.Topic] == nil {
			last[r.Topic] = map[int32]int64{}
		}
		last[r.Topic][r.Partition] = max(last[r.Topic][r.Partition], r.Offset)
	}
	for topic, parts := range last {
		ends := harness.EndOffsets(t, e.Kafka.Brokers(), topic)
		for p, off := range parts {
			if ends[p] <= off+1 {
				t.Fatalf("%s/%d ends at %d, right after its last record at %d: no transaction marker to step over", topic, p, ends[p], off)
			}
		}
	}

	started := time.Now()
	code, rep := e.reconcile(append(window, "--margin", "0s", "--stall-timeout", "20s")...)
	if code != 0 || len(rep.Missing) != 0 || rep.Found != int64(len(ids)) || rep.RowsChecked != int64(len(ids)) {
		t.Fatalf("reconcile exited %d with %d missing, %d found of %d checked; want 0, 0, %d of %d",
			code, len(rep.Missing), rep.Found, rep.RowsChecked, len(ids), len(ids))
	}
	if len(rep.Phantoms) != 0 || len(rep.Duplicated) != 0 {
		t.Fatalf("phantoms %+v, delivered more than once %v: the aborted record %s counted", rep.Phantoms, rep.Duplicated, aborted)
	}
	if took := time.Since(started); took > 15*time.Second {
		t.Errorf("reconcile took %v: it waited on a marker", took)
	}
}
