package ops

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Issue 51.6: a recovery of a lost slot sent no watchdog ping and no
// status. With a writer's transaction open across the loss,
// CREATE_REPLICATION_SLOT waits for it to end: no WATCHDOG=1 for 65 s
// against the shipped unit's WatchdogSec=60s, so systemd would kill the
// relay and it would begin the recovery again, for ever; /readyz, /slot and
// STATUS= said connecting, with the previous error, throughout. Now the
// state is recovering with how far it is, and the pings go on.
func TestNotifyWatchdogWhileRecovering(t *testing.T) {
	t.Parallel()
	const watchdog = 2 * time.Second
	e := newEnv(t)
	e.Migrate() // the slot, and the record that says it was made
	ids := insert(t, e.DB.DSN(), "order", 20)
	e.DB.DropSlot(t, e.Slot)

	// A transaction holding an xid: the new slot waits for it.
	ctx := context.Background()
	holder, err := pgx.Connect(ctx, e.DB.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close(ctx)
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT pg_current_xact_id()"); err != nil {
		t.Fatal(err)
	}

	// A writer at about 50 events/s throughout: the recovery must leave
	// none of its events behind, those committed while the new slot
	// waits included.
	stopWriting := make(chan struct{})
	written := make(chan []string, 1)
	go func() {
		var ids []string
		defer func() { written <- ids }()
		conn, err := pgx.Connect(ctx, e.DB.DSN())
		if err != nil {
			t.Errorf("writer: %v", err)
			return
		}
		defer conn.Close(ctx)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stopWriting:
				return
			case <-tick.C:
			}
			id := harness.NewUUID()
			if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
				VALUES ($1, 'order', 'written-on', 'Happened', '{}')`, id); err != nil {
				t.Errorf("writer: %v", err)
				return
			}
			ids = append(ids, id)
		}
	}()
	writerStopped := false
	stopWriter := func() []string {
		if writerStopped {
			return nil
		}
		writerStopped = true
		close(stopWriting)
		return <-written
	}
	defer stopWriter()

	sock := listenNotify(t)
	p := e.start(e.argsAs(e.DB.DSN(), "run", "--on-slot-lost", "recover", "--status-interval", "250ms"), sock.env(watchdog)...)
	base := p.AdminURL(t)
	harness.WaitFor(t, time.Minute, "the relay waits in CREATE_REPLICATION_SLOT", func() bool {
		return p.Exited() || e.DB.QueryInt64(t, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender' AND datname = current_database() AND query LIKE 'CREATE_REPLICATION_SLOT%'") > 0
	})
	waiting := time.Now()
	// Three watchdog periods with the recovery held: systemd would have
	// killed a relay that went silent.
	sock.checkPingsSince(t, waiting, "recovering, waiting for the new slot", watchdog)
	harness.WaitFor(t, time.Minute, "3 watchdog periods of waiting", func() bool { return time.Since(waiting) > 3*watchdog })
	sock.checkPingsSince(t, waiting, "recovering, waiting for the new slot", watchdog)

	if n := sock.count("STATUS=recovering the lost slot: making the new slot*"); n == 0 {
		t.Errorf("no STATUS= saying the relay is making the new slot:\n%s", sock.lines())
	}
	code, body := harness.HTTPGet(t, base+"/slot")
	var slot struct {
		Relay struct {
			State  string `json:"state"`
			Detail string `json:"detail"`
		} `json:"relay"`
	}
	if err := json.Unmarshal([]byte(body), &slot); err != nil || code != http.StatusOK {
		t.Fatalf("/slot: %d %v %s", code, err, body)
	}
	if slot.Relay.State != "recovering" || !strings.Contains(slot.Relay.Detail, "making the new slot") {
		t.Errorf("/slot while recovering says state %q, detail %q; want recovering and what it waits for", slot.Relay.State, slot.Relay.Detail)
	}
	if code, _ := harness.HTTPGet(t, base+"/readyz"); code == http.StatusOK {
		t.Errorf("/readyz says ready while the relay recovers and publishes nothing new")
	}
	if n := sock.count("READY=1"); n != 0 {
		t.Errorf("READY=1 while recovering:\n%s", sock.lines())
	}

	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, time.Minute, "READY=1 once recovered", func() bool { return sock.count("READY=1") > 0 })
	harness.WaitFor(t, time.Minute, "the writer goes on after the recovery", func() bool { return time.Since(waiting) > 6*watchdog })
	during := stopWriter()
	t.Logf("%d events before the loss, %d written by the writer meanwhile", len(ids), len(during))
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, append(ids, during...), time.Minute)
	if !strings.Contains(p.Output(), "recovered the lost replication slot") {
		t.Errorf("no recovery logged:\n%s", harness.LastLines(p.Output(), 10))
	}
}
