package drills

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillPostgresImmediateShutdown crashes PostgreSQL (pg_ctl stop -m
// immediate: no checkpoint) while the relay works through a backlog, then
// starts it again. The same relay process must reconnect by itself, and
// every committed event must arrive. The slot's position reaches disk only
// at checkpoints, so after the crash it may go back and re-send: duplicates
// are expected, losses are not.
func TestDrillPostgresImmediateShutdown(t *testing.T) {
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{})
	w, _ := newKfakeWorld(t, pg)
	off := newOffsets(t, w.Brokers)
	relay := w.startRelay()

	// The service keeps writing until the crash; the transaction whose
	// COMMIT got no answer is in doubt and is looked up afterwards.
	conn := w.connect()
	wrng := writerRand(rng)
	var doubt inDoubt
	crashedWriter := runWriter(func() error {
		for {
			events := w.genEvents(wrng, 20, 500)
			ids := make([]string, len(events))
			for i := range ids {
				ids[i] = harness.NewUUID()
			}
			if err := w.CommitIDs(context.Background(), conn, ids, events); err != nil {
				doubt = inDoubt{ids: ids, events: events}
				return err
			}
		}
	})
	harness.WaitFor(t, 2*time.Minute, "the relay streams a busy outbox", func() bool {
		m, err := off.read(w.topics())
		return err == nil && sumOffsets(m) >= 3000
	})
	pg.StopImmediate(t)
	crashed := time.Now()
	werr := crashedWriter()
	m, err := off.read(w.topics())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("PostgreSQL crashed with %d events committed, %d records in Kafka (writer stopped on: %v)",
		w.CommittedCount(), sumOffsets(m), werr)
	streams := strings.Count(relay.Output(), harness.LogStreaming)
	pg.Start(t)
	restarted := time.Now()
	harness.WaitFor(t, 2*time.Minute, "the relay streams again", func() bool {
		return relay.Exited() || strings.Count(relay.Output(), harness.LogStreaming) > streams
	})
	if relay.Exited() {
		t.Fatalf("relay exited after the PostgreSQL crash instead of reconnecting:\n%s", relay.Output())
	}
	t.Logf("relay streaming again %v after PostgreSQL came back (%v after the crash)",
		time.Since(restarted).Round(time.Millisecond), time.Since(crashed).Round(time.Millisecond))

	doubt.settle(t, w)
	if n := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events"); n != int64(w.CommittedCount()) {
		t.Fatalf("table holds %d events, the writer knows of %d", n, w.CommittedCount())
	}
	conn2, err := pgx.Connect(context.Background(), w.DB.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close(context.Background())
	if err := w.writeTxns(conn2, rng, 100, 10, 500); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	t.Logf("%d records for %d events (%d duplicates); %d stream restarts in one process",
		len(records), w.CommittedCount(), len(records)-w.CommittedCount(), strings.Count(relay.Output(), msgRestart))
}

// TestDrillReplicationConnectionCut puts a TCP proxy between the relay and
// PostgreSQL and cuts every connection mid-stream, several times, as a
// network failure or a load balancer would. The relay must notice, back
// off, reconnect and lose nothing (risks: hanging on a dead socket,
// confirming from a stale session, a restart loop that gives up).
func TestDrillReplicationConnectionCut(t *testing.T) {
	const cuts = 3
	rng := newRand(t)
	w, k := kfakeWorld(t, harness.KfakeOptions{})
	proxy := harness.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", shared.Port()))
	w.relayDSN = strings.Replace(w.DB.DSN(), fmt.Sprintf("127.0.0.1:%d", shared.Port()), proxy.Addr(), 1)
	if w.relayDSN == w.DB.DSN() {
		t.Fatalf("could not point the DSN %s at the proxy", w.DB.DSN())
	}
	off := newOffsets(t, k.Brokers())
	relay := w.startRelay()
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 10*time.Millisecond, 10, 300, false)
	defer pw.halt()

	var reconnects []time.Duration
	last := int64(0)
	for i := 0; i < cuts; i++ {
		harness.WaitFor(t, 2*time.Minute, "the relay delivers more events", func() bool {
			m, err := off.read(w.topics())
			return err == nil && sumOffsets(m) >= last+500
		})
		streams := strings.Count(relay.Output(), harness.LogStreaming)
		open := proxy.Connections()
		proxy.CutAll()
		cut := time.Now()
		harness.WaitFor(t, 2*time.Minute, "the relay streams again after the cut", func() bool {
			return relay.Exited() || strings.Count(relay.Output(), harness.LogStreaming) > streams
		})
		if relay.Exited() {
			t.Fatalf("relay exited after a connection cut:\n%s", relay.Output())
		}
		reconnects = append(reconnects, time.Since(cut).Round(time.Millisecond))
		m, err := off.read(w.topics())
		if err != nil {
			t.Fatal(err)
		}
		last = sumOffsets(m)
		t.Logf("cut %d: %d connections cut with %d records in Kafka; streaming again after %v", i+1, open, last, reconnects[i])
	}
	if err := pw.halt(); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	t.Logf("%d cuts, reconnect times %v; %d records for %d events", cuts, reconnects, len(records), w.CommittedCount())
	// Each cut ends a session that streamed: a separate outage, which
	// starts again from the shortest delay instead of counting on.
	restarts := regexp.MustCompile(`"attempt":(\d+)[^\n]*"message":"stream stopped`).FindAllStringSubmatch(relay.Output(), -1)
	if len(restarts) < cuts {
		t.Fatalf("%d stream restarts logged for %d cuts:\n%s", len(restarts), cuts, relay.Output())
	}
	for i, m := range restarts {
		if m[1] != "1" {
			t.Errorf("restart %d after a session that streamed is attempt %s, want 1: the delay grew across separate outages", i+1, m[1])
		}
	}
}

// checkSlotTimeLeft writes WAL beside the streaming relay and checks its
// guard: /slot's time left is safe_wal_size over the WAL rate it shows,
// that rate is the server's (within what the minute it averages over and
// the test's own span can differ by), and the metric says the same.
func checkSlotTimeLeft(t *testing.T, w *world, relay *harness.Process) {
	t.Helper()
	base := relay.AdminURL(t)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("relay output:\n%s", relay.Output())
		}
	})
	var doc struct {
		Slot struct {
			SafeWALSize *int64 `json:"safe_wal_size"`
		} `json:"slot"`
		WALRate  *float64 `json:"wal_rate_bytes_per_second"`
		TimeLeft *float64 `json:"time_left_seconds"`
		Limit    string   `json:"time_left_limit"`
	}
	from, began := w.DB.CurrentLSN(t), time.Now()
	// About 0.5 MB/s: at 200 rows a turn (about 10 MB/s) PostgreSQL
	// invalidated the 1 MB slot at a checkpoint while the relay streamed
	// and kept up, and the relay stopped with the invalidation error, as
	// it must; that is the short time left this guard warns of.
	harness.WaitFor(t, time.Minute, "the slot's time left from max_slot_wal_keep_size in /slot", func() bool {
		w.DB.Exec(t, "INSERT INTO filler (v) SELECT repeat('f', 1000) FROM generate_series(1, 10)")
		_, body := harness.HTTPGet(t, base+"/slot")
		doc.TimeLeft, doc.WALRate = nil, nil
		if err := json.Unmarshal([]byte(body), &doc); err != nil {
			t.Fatalf("/slot: %v\n%s", err, body)
		}
		return doc.TimeLeft != nil && doc.WALRate != nil && *doc.WALRate > 0 && time.Since(began) > 10*time.Second
	})
	written := w.DB.QueryInt64(t, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '"+from+"')::bigint")
	serverRate := float64(written) / time.Since(began).Seconds()
	if doc.Limit != "max_slot_wal_keep_size" || doc.Slot.SafeWALSize == nil {
		t.Fatalf("/slot's time left comes from %q with safe_wal_size %v, want max_slot_wal_keep_size", doc.Limit, doc.Slot.SafeWALSize)
	}
	if want := max(float64(*doc.Slot.SafeWALSize), 0) / *doc.WALRate; math.Abs(*doc.TimeLeft-want) > 1e-6*want+1e-9 {
		t.Errorf("/slot's time left %.3f s, want safe_wal_size %d / rate %.0f B/s = %.3f s", *doc.TimeLeft, *doc.Slot.SafeWALSize, *doc.WALRate, want)
	}
	if r := *doc.WALRate / serverRate; r < 0.1 || r > 10 {
		t.Errorf("/slot's WAL rate %.0f B/s against %.0f B/s measured here: %.2f times", *doc.WALRate, serverRate, r)
	}
	// 1 MB at this rate lasts seconds: the metric must say a short time.
	if left := harness.Metric(t, base, "outbox_relay_slot_time_left_seconds"); math.IsInf(left, 0) || left < 0 || left > 600 {
		t.Errorf("outbox_relay_slot_time_left_seconds = %v with 1 MB kept at %.0f B/s", left, serverRate)
	}
	t.Logf("time left %.1f s: safe_wal_size %d B at %.0f B/s (server: %.0f B/s)", *doc.TimeLeft, *doc.Slot.SafeWALSize, *doc.WALRate, serverRate)
}

// TestDrillSlotInvalidated lets PostgreSQL invalidate the relay's slot
// (max_slot_wal_keep_size exceeded while the relay was down: wal_status =
// lost, and on 17+ invalidation_reason = wal_removed, which the relay must
// name). The relay warns at start how little WAL it may fall behind by.
// The events in the removed WAL are gone from the slot, so the relay
// must refuse to start, loudly, explaining that events may have been lost
// and what the operator can do, and must never silently create a new slot
// (which would hide the loss). With --recreate-lost-slot it recreates the
// slot and streams what is committed from then on.
func TestDrillSlotInvalidated(t *testing.T) {
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{Settings: map[string]string{
		"max_slot_wal_keep_size": "1MB",
		"wal_keep_size":          "0",
		"max_wal_size":           "32MB",
		"min_wal_size":           "32MB",
	}})
	w, _ := newKfakeWorld(t, pg)
	conn := w.connect()
	relay := w.startRelay("--admin-addr", "127.0.0.1:0")
	harness.WaitFor(t, time.Minute, "the relay's warning about max_slot_wal_keep_size", func() bool {
		return strings.Contains(relay.Output(), "max_slot_wal_keep_size is 1 MB: the relay may be down or behind only for as long as the server takes to write 1 MB of WAL")
	})
	w.DB.Exec(t, "CREATE TABLE filler (id bigserial PRIMARY KEY, v text)")
	checkSlotTimeLeft(t, w, relay)
	if err := w.writeTxns(conn, rng, 10, 5, 20); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute)
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("relay exited %d (%v) on SIGTERM, want 0", code, err)
	}
	delivered, _ := w.Committed()

	// Committed while the relay is down, then lost with the WAL.
	if err := w.writeTxns(conn, rng, 5, 2, 20); err != nil {
		t.Fatal(err)
	}
	all, _ := w.Committed()
	lost := append([]string(nil), all[len(delivered):]...)
	w.Forget(lost) // the drill checks them separately
	harness.WaitFor(t, 3*time.Minute, "PostgreSQL invalidates the slot", func() bool {
		w.DB.Exec(t, "INSERT INTO filler (v) SELECT repeat('f', 1000) FROM generate_series(1, 4000)")
		w.DB.Exec(t, "SELECT pg_switch_wal()")
		w.DB.Exec(t, "CHECKPOINT")
		return pg.SlotInfo(t, w.DB.Name(), w.Slot).WALStatus == "lost"
	})
	slots := func() int64 {
		return w.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")
	}

	p := w.startRelayNoWait()
	code, err := p.Wait(2 * time.Minute)
	if err != nil {
		t.Fatalf("relay kept running on an invalidated slot: %v\n%s", err, p.Output())
	}
	out := p.Output()
	if code == 0 {
		t.Errorf("relay exited 0 on an invalidated slot; want non-zero")
	}
	wants := []string{"wal_status=lost", "may never reach Kafka", "--recreate-lost-slot", w.Slot}
	if pg.Major(t) >= 17 {
		wants = append(wants, "invalidation_reason=wal_removed") // the server's own word for it
	}
	for _, want := range wants {
		if !strings.Contains(out, want) {
			t.Errorf("relay's failure does not say %q; output:\n%s", want, out)
		}
	}
	if si := pg.SlotInfo(t, w.DB.Name(), w.Slot); !si.Exists || si.WALStatus != "lost" {
		t.Errorf("after the refusal the slot is %+v; want the invalidated slot left as it was (not recreated)", si)
	}
	if n := slots(); n != 1 {
		t.Errorf("%d slots on the database after the refusal; want the one invalidated slot, no new one", n)
	}
	t.Logf("refused with exit %d: %s", code, lastLogMessage(out))

	relay = w.startRelay("--recreate-lost-slot")
	if !strings.Contains(relay.Output(), "dropped and recreated it") {
		t.Errorf("relay did not say it recreates the lost slot; output:\n%s", relay.Output())
	}
	if si := pg.SlotInfo(t, w.DB.Name(), w.Slot); !si.Exists || si.WALStatus == "lost" {
		t.Fatalf("slot after --recreate-lost-slot: %+v", si)
	}
	before := w.CommittedCount()
	if err := w.writeTxns(conn, rng, 10, 5, 20); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(2 * time.Minute)
	ids, _ := w.Committed()
	harness.CheckNoLoss(t, records, append(append([]string(nil), delivered...), ids[before:]...))
	got := map[string]bool{}
	for _, r := range records {
		got[r.EventID()] = true
	}
	missing := 0
	for _, id := range lost {
		if !got[id] {
			missing++
		}
	}
	t.Logf("%d events committed while the slot was lost, %d of them never delivered (as the relay warned); %d events after the recreate all delivered",
		len(lost), missing, len(ids)-before)
}

// lastLogMessage is the message of the last JSON log line in out.
func lastLogMessage(out string) string {
	lines := harness.LogLines(out)
	if len(lines) == 0 {
		return ""
	}
	return lines[len(lines)-1].Str("message")
}

// TestDrillIdleConfirmAfterBurst: the outbox goes idle right after a
// burst whose acks were still pending when the walsender's keepalive
// reported the WAL end (only other tables wrote after the burst). Once the
// acks are in, that WAL end is safe to confirm, the rule PostgreSQL's own
// apply worker follows, and the slot must get there without waiting for
// more WAL: otherwise the slot holds the tail WAL, and reports lag, until
// the database writes again (the "idle outbox, busy database" complaint,
// Redpanda Connect #3198, PeerDB #429, Sequin #1141, in its after-a-burst
// form).
//
// The drill runs on a dedicated cluster without autovacuum and judges only
// a window in which the server wrote no WAL at all; background WAL (the
// bgwriter logs a snapshot every 15s on a busy server) would produce a new
// keepalive and let even a relay with this bug confirm. Such a window is
// inconclusive and the scenario is repeated.
func TestDrillIdleConfirmAfterBurst(t *testing.T) {
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{Settings: map[string]string{"autovacuum": "off"}})
	w, k := newKfakeWorld(t, pg)
	w.DB.Exec(t, "CREATE TABLE other (id bigserial PRIMARY KEY, v text)")
	conn := w.connect()
	w.startRelay()
	if err := w.writeTxns(conn, rng, 5, 5, 20); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute)

	// A few status intervals (1s each) are plenty for the relay to confirm.
	const within = 4 * time.Second
	for attempt := 1; attempt <= 3; attempt++ {
		release := k.HoldProduce()
		if err := w.writeTxns(conn, rng, 20, 5, 20); err != nil {
			release()
			t.Fatal(err)
		}
		harness.WaitFor(t, time.Minute, "the burst reaches the broker", func() bool { return k.HeldProduces() > 0 })
		w.DB.Exec(t, "INSERT INTO other (v) SELECT repeat('o', 500) FROM generate_series(1, 200)")
		tail := w.DB.CurrentLSN(w.T)
		// The relay reports having read the tail (its write position)
		// while the burst is still unacknowledged.
		harness.WaitFor(t, time.Minute, "the relay reads past the tail", func() bool {
			return harness.LSNAtMost(tail, w.DB.QueryString(t, `SELECT r.write_lsn::text FROM pg_stat_replication r
				JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $1`, w.Slot))
		})
		release()
		w.consumeAll(time.Minute)
		released := time.Now()
		quiet := true
		confirmed := harness.Poll(within, func() bool {
			quiet = quiet && w.DB.CurrentLSN(w.T) == tail
			return harness.LSNAtMost(tail, w.ConfirmedFlush())
		})
		quiet = quiet && w.DB.CurrentLSN(w.T) == tail
		switch {
		case !quiet:
			t.Logf("attempt %d inconclusive: the server wrote WAL past %s meanwhile", attempt, tail)
			continue
		case !confirmed:
			t.Fatalf("slot still at %s %v after the burst's acks, though the relay had read to %s with nothing left in flight "+
				"and the server wrote nothing since: WAL that only other tables wrote is held until the database writes again",
				w.ConfirmedFlush(), time.Since(released).Round(time.Millisecond), tail)
		}
		t.Logf("slot reached the tail %s within %v of the acks", tail, time.Since(released).Round(time.Millisecond))
		return
	}
	t.Skip("SKIPPING: no attempt had a window without background WAL; nothing was proven")
}
