package e2e

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Issue 11.1: with the relay streaming, the walsender terminated and the
// slot dropped, the relay backed off, created a new slot at the current
// position and went on streaming; /readyz stayed 200 and the events
// committed in the gap never reached Kafka. Once a relay has streamed from
// a slot, a missing slot is fatal: it exits 1, names the slot and the way
// back, and never streams from (or creates) a new one. (Issue 51: the way
// back is a choice of the relay's, each of which makes the new slot before
// it reads the table, no longer migrate and reconcile by hand.)
func TestDroppedSlotUnderRunningRelayIsFatal(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	admin := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	p := e.StartRelay("--admin-addr", admin)
	conn := e.DB.Connect(t)
	ctx := context.Background()
	if err := e.writeEvents(conn, 1, 1, 1); err != nil {
		t.Fatal(err)
	}
	written := e.DB.CurrentLSN(t)
	harness.WaitFor(t, 30*time.Second, "the first event in Kafka", func() bool {
		return len(e.ConsumeAll(time.Second)) == 1
	})
	// Once the slot passed it, the relay knows the commit time to name in
	// the reconcile advice.
	harness.WaitFor(t, 30*time.Second, "the slot confirmed past the first event", func() bool {
		return harness.LSNAtMost(written, e.ConfirmedFlush())
	})
	ready := func() bool {
		resp, err := http.Get("http://" + admin + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}
	if !ready() {
		t.Fatal("/readyz is not 200 while streaming")
	}

	// Terminate the walsender and drop the slot before the relay's next
	// session takes it again.
	harness.WaitFor(t, 30*time.Second, "the slot dropped", func() bool {
		var dropped bool
		err := conn.QueryRow(ctx, `
			WITH kill AS (SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL)
			SELECT count(*) = 0 FROM kill`, e.Slot).Scan(&dropped)
		if err != nil || !dropped {
			return false
		}
		_, err = conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", e.Slot)
		return err == nil
	})
	var readyAfterDrop atomic.Bool
	stopWatching := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for {
			select {
			case <-stopWatching:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if ready() {
				readyAfterDrop.Store(true)
			}
		}
	}()
	if err := e.writeEvents(conn, 3, 1, 1); err != nil {
		t.Fatal(err)
	}

	code, err := p.Wait(time.Minute)
	close(stopWatching)
	<-watched
	if err != nil || code != 1 {
		t.Fatalf("relay exited %d (%v), want 1:\n%s", code, err, p.Output())
	}
	out := p.Output()
	if !outputHas(out, `replication slot \"`+e.Slot+`\" no longer exists`, "the last commit it confirmed: 20", "--on-slot-lost recover", "--existing-rows pending") {
		t.Errorf("the exit does not name the slot, the ways back and the last confirmed commit time:\n%s", out)
	}
	if strings.Contains(out, "created the replication slot") {
		t.Errorf("the relay created a new slot:\n%s", out)
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", e.Slot); n != 0 {
		t.Errorf("a slot named %s exists after the relay exited", e.Slot)
	}
	if readyAfterDrop.Load() {
		t.Error("/readyz went back to 200 after the slot was dropped")
	}
}

// Issue 24.14: a first run that never reached Kafka (a wrong password the
// broker answers with EOF, a wrong address) created its slot all the same,
// and the unused slot held WAL. The relay now checks Kafka before it
// creates a slot: while Kafka cannot be reached there is none, and once it
// can, the slot is created and events flow.
func TestSlotIsNotCreatedBeforeKafkaAnswers(t *testing.T) {
	e := newEnv(t)
	e.Migrate("--skip-slot")
	unreachable := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	flags := harness.RelayFlags{DSN: e.DB.DSN(), Slot: e.Slot, Brokers: []string{unreachable}, AdminAddr: "127.0.0.1:0"}
	p := harness.StartProcess(t, e.Bin, flags.Args("run"), nil)
	p.WaitForOutput(t, "retry_in", time.Minute) // the first attempt failed and waits for the next
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", e.Slot); n != 0 {
		t.Fatalf("the relay created its slot though it never reached Kafka:\n%s", harness.LastLines(p.Output(), 10))
	}
	if !strings.Contains(p.Output(), "replication slot was not created") {
		t.Fatalf("the log does not say the slot was not created:\n%s", harness.LastLines(p.Output(), 10))
	}
	if code, err := p.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("relay exited %d (%v) on SIGTERM", code, err)
	}

	e.StartRelay()
	ctx := context.Background()
	if err := e.Commit(ctx, e.DB.Connect(t), []harness.OutboxEvent{{AggregateType: "order", AggregateID: "o-1", EventType: "Placed", Payload: `{}`}}); err != nil {
		t.Fatal(err)
	}
	ids, _ := e.Committed()
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, ids, time.Minute)
}
