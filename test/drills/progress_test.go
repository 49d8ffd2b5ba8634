package drills

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// progressTopic is the relay's default progress topic.
const progressTopic = "outbox-relay.progress"

// storedProgress reads the progress topic with franz-go and returns the LSN
// and timeline of the newest record whose key starts with "<slot>@", or ""
// when there is none. It decodes the JSON itself: the relay's code must not
// be what proves the relay right.
func storedProgress(t testing.TB, brokers []string, slot string) (lsn string, timeline int) {
	t.Helper()
	v := latestProgress(t, brokers, slot)
	return v.LSN, v.Timeline
}

// progressValue is what the drills read of a progress record.
type progressValue struct {
	Version       int    `json:"version"`
	LSN           string `json:"lsn"`
	Timeline      int    `json:"timeline"`
	CommitTime    string `json:"commit_time"`
	RecoverySince string `json:"recovery_since"`
}

// latestProgress is storedProgress's whole record: the newest one for
// slot, zero when there is none.
func latestProgress(t testing.TB, brokers []string, slot string) progressValue {
	t.Helper()
	var latest progressValue
	end := sumOffsets(endOffsets(t, brokers, []string{progressTopic})) // one partition
	if end == 0 {
		return latest
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(progressTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var next int64
	for next < end {
		polled := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read the progress topic: reached offset %d of %d", next, end)
		}
		polled.EachRecord(func(r *kgo.Record) {
			next = r.Offset + 1
			if !strings.HasPrefix(string(r.Key), slot+"@") {
				return
			}
			var v progressValue
			if err := json.Unmarshal(r.Value, &v); err != nil || v.Version != 1 {
				t.Fatalf("progress record %q is not version 1 JSON: %v", r.Value, err)
			}
			latest = v
		})
	}
	return latest
}

// waitProgressAt waits until the stored progress reaches at least lsn.
func (w *world) waitProgressAt(lsn string) {
	w.T.Helper()
	harness.WaitFor(w.T, time.Minute, "the progress record reaches "+lsn, func() bool {
		got, _ := storedProgress(w.T, w.Brokers, w.Slot)
		return harness.LSNAtMost(lsn, got)
	})
}

// on returns a world for the same database name on another cluster (a
// restored backup, a promoted standby), with a fresh ledger.
func (w *world) on(pg *harness.Postgres) *world {
	env := *w.Env
	env.DB, env.Ledger = pg.DB(w.DB.Name()), harness.NewLedger()
	c := &world{Env: &env, pg: pg, topicPrefix: w.topicPrefix, types: w.types}
	c.relayDSN = c.DB.DSN()
	return c
}

// restartRelayed restarts PostgreSQL (stop runs the stop) under a running
// relay and waits until the relay streams again; it returns the slot's
// confirmed position before and after.
func (w *world) restartUnder(relay *harness.Process, stop func(testing.TB)) (before, after string) {
	w.T.Helper()
	before = w.ConfirmedFlush()
	streams := strings.Count(relay.Output(), harness.LogStreaming)
	stop(w.T)
	w.pg.Start(w.T)
	after = w.ConfirmedFlush()
	harness.WaitFor(w.T, 2*time.Minute, "the relay streams again", func() bool {
		return relay.Exited() || strings.Count(relay.Output(), harness.LogStreaming) > streams
	})
	if relay.Exited() {
		w.T.Fatalf("relay exited after the PostgreSQL restart:\n%s", relay.Output())
	}
	return before, after
}

// noCheckpoints keeps PostgreSQL from checkpointing during a drill, so the
// slot is saved only at its creation and at a shutdown checkpoint: the
// restart then takes it back as far as it goes in production after a quiet
// spell, and a relay without progress re-delivers everything.
var noCheckpoints = harness.PGOptions{Settings: map[string]string{"checkpoint_timeout": "1h", "max_wal_size": "4GB"}}

// TestDrillProgressRestartCaughtUp restarts PostgreSQL under a relay that
// has delivered everything, once with a fast shutdown and once with an
// immediate one (a crash). PostgreSQL 15 brings the slot back to its last
// save (here: its creation) either way, and before the progress topic the
// relay sent every event again. Now it starts from the progress record:
// nothing committed before the restart may be delivered twice, and nothing
// may be lost.
func TestDrillProgressRestartCaughtUp(t *testing.T) {
	for _, mode := range []string{"fast", "immediate"} {
		t.Run(mode, func(t *testing.T) {
			pg := harness.StartPostgres(t, noCheckpoints)
			w, _ := newKfakeWorld(t, pg)
			restartCaughtUp(t, w, mode)
		})
	}
}

// TestDrillProgressRestartCaughtUpApacheKafka is the fast restart against
// Apache Kafka: the record is read back with read requests at the last stable
// offset (read_committed), whose answers kfake only imitates.
func TestDrillProgressRestartCaughtUpApacheKafka(t *testing.T) {
	pg := harness.StartPostgres(t, noCheckpoints)
	w := newWorld(t, pg, nil)
	w.topicPrefix = "drill_progress."
	k := requireKafka(t, harness.ApacheKafkaOptions{Version: harness.ApacheKafka4Version, Nodes: 1}, w.topics(), 1, nil)
	w.Brokers = k.Brokers()
	w.Migrate()
	restartCaughtUp(t, w, "fast")
}

// restartCaughtUp is the caught-up restart drill on a migrated world with
// its own cluster; mode is pg_ctl's stop mode.
func restartCaughtUp(t *testing.T, w *world, mode string) {
	rng := newRand(t)
	pg := w.pg
	admin := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	relay := w.startRelay("--status-interval", "300ms", "--admin-addr", admin)
	conn := w.connect()
	events := harness.Sized(3000, 30000)
	if err := w.writeTxns(conn, rng, events/10, 10, 200); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(3 * time.Minute)
	w.waitProgressAt(w.ConfirmedFlush())
	conn.Close(context.Background())

	stop := pg.Stop
	if mode == "immediate" {
		stop = pg.StopImmediate
	}
	before, after := w.restartUnder(relay, stop)
	t.Logf("slot confirmed_flush_lsn %s before the %s restart, %s after", before, mode, after)
	// PostgreSQL 17 and newer save the slot at a clean shutdown, so after a
	// fast restart the slot itself is where the relay was, and the start
	// comes from it; 15 and 16, and any version after a crash, take the
	// slot back, and the progress record must carry the start.
	wantSource := "progress"
	if mode == "fast" && pg.Major(t) >= 17 {
		wantSource = "slot"
		if after != before {
			t.Errorf("PostgreSQL %d took the slot back from %s to %s at a fast restart; it saves slots at shutdown", pg.Major(t), before, after)
		}
	}
	if !strings.Contains(relay.Output(), `"start_source":"`+wantSource+`"`) {
		t.Errorf("the restart did not start from the %s:\n%s", wantSource, tail(relay.Output(), 20))
	}
	var slot struct {
		Relay struct {
			Progress struct {
				LSN         string `json:"lsn"`
				StartSource string `json:"last_start_source"`
			} `json:"progress"`
		} `json:"relay"`
	}
	getJSON(t, "http://"+admin+"/slot", &slot)
	if p := slot.Relay.Progress; p.StartSource != wantSource || !harness.LSNAtMost(before, p.LSN) {
		t.Errorf("/slot shows progress %+v; want the last start from the %s, at or past %s", p, wantSource, before)
	}
	status := harness.StartProcess(t, w.Bin, append(w.args("status"), "--kafka-brokers", strings.Join(w.Brokers, ",")), nil)
	if code, err := status.Wait(time.Minute); err != nil || code != 0 {
		t.Fatalf("status exited %d (%v):\n%s", code, err, status.Output())
	}
	var st struct {
		Progress struct {
			LSN    string `json:"lsn"`
			Source string `json:"next_start_source"`
		} `json:"progress"`
	}
	if err := json.Unmarshal([]byte(status.Output()), &st); err != nil || !harness.LSNAtMost(before, st.Progress.LSN) || st.Progress.Source == "" {
		t.Errorf("status shows progress %+v (%v); want it at or past %s:\n%s", st.Progress, err, before, status.Output())
	}

	conn2, err := pgx.Connect(context.Background(), w.DB.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close(context.Background())
	if err := w.writeTxns(conn2, rng, 10, 10, 200); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	if dups := harness.Duplicates(records); len(dups) != 0 {
		t.Fatalf("%d events delivered more than once after a %s restart of a caught-up relay (want 0: the progress record covered them all)", len(dups), mode)
	}
	t.Logf("%d records for %d events: no re-delivery", len(records), w.CommittedCount())
}

// TestDrillProgressRestartMidStream crashes PostgreSQL (immediate) while a
// writer commits and the relay streams. Re-delivery must stay within the
// documented bound: the in-flight window plus what one status interval
// confirms (the record is written at most once per interval), here with a
// margin of one more interval for the write itself. Without progress every
// event since the slot's creation came again.
//
// It runs with a fast shutdown too: PostgreSQL 17 and newer save the slot
// then, 15 and 16 take it back as far as a crash does.
func TestDrillProgressRestartMidStream(t *testing.T) {
	for _, mode := range []string{"immediate", "fast"} {
		t.Run(mode, func(t *testing.T) { restartMidStream(t, mode) })
	}
}

func restartMidStream(t *testing.T, mode string) {
	const (
		maxInFlight = 500
		interval    = 250 * time.Millisecond
		every       = 5 * time.Millisecond
		perTxn      = 10
	)
	rng := newRand(t)
	pg := harness.StartPostgres(t, noCheckpoints)
	w, k := newKfakeWorld(t, pg)
	off := newOffsets(t, k.Brokers())
	relay := w.startRelay("--status-interval", interval.String(), "--max-in-flight-events", "500")
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), every, perTxn, 200, false)
	before := int64(harness.Sized(6000, 30000))
	harness.WaitFor(t, 3*time.Minute, "the relay streams a busy outbox", func() bool {
		m, err := off.read(w.topics())
		return err == nil && sumOffsets(m) >= before
	})
	major := pg.Major(t)
	if mode == "fast" {
		pg.Stop(t)
	} else {
		pg.StopImmediate(t)
	}
	werr := pw.halt() // the stop ends it; its last COMMIT is in doubt until settled below
	t.Logf("PostgreSQL %d stopped (-m %s) with %d events committed (writer stopped on: %v)", major, mode, w.CommittedCount(), werr)
	streams := strings.Count(relay.Output(), harness.LogStreaming)
	pg.Start(t)
	harness.WaitFor(t, 2*time.Minute, "the relay streams again", func() bool {
		return relay.Exited() || strings.Count(relay.Output(), harness.LogStreaming) > streams
	})
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	// The in-doubt transaction goes into the ledger in the writer's own
	// insert order: its rows share created_at, so the table cannot give
	// their order, and a guessed one made the order check fail by chance.
	pw.doubt.settle(t, w)
	checkLedgerHoldsTable(t, w)
	conn2, err := pgx.Connect(context.Background(), w.DB.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close(context.Background())
	if err := w.writeTxns(conn2, rng, 20, perTxn, 200); err != nil {
		t.Fatal(err)
	}
	records := w.waitSettled(3 * time.Minute)
	w.checkDelivery(records)
	rate := float64(perTxn) / every.Seconds() // the writer's pace, events/s
	bound := maxInFlight + int(2*rate*interval.Seconds())
	again := 0
	for _, n := range harness.Duplicates(records) {
		again += n - 1
	}
	t.Logf("PostgreSQL %d, -m %s: %d events committed, %d re-delivered after the restart (bound %d: in-flight %d + 2 status intervals at %.0f events/s)",
		major, mode, w.CommittedCount(), again, bound, maxInFlight, rate)
	if again > bound {
		t.Fatalf("%d events re-delivered after a PostgreSQL restart (-m %s); the bound is %d", again, mode, bound)
	}
}

// checkLedgerHoldsTable fails unless every row of the outbox table is in
// the ledger: a commit the writer did not record would go unchecked.
func checkLedgerHoldsTable(t *testing.T, w *world) {
	t.Helper()
	ids, _ := w.Committed()
	if n := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events WHERE NOT event_id = ANY($1::uuid[])", ids); n != 0 {
		t.Fatalf("the outbox table holds %d rows the writer did not record as committed", n)
	}
}

// retirePrimary lets the relay deliver and record everything, stops it
// (SIGTERM) and then the world's cluster, which comes back only for the
// world's cleanup to drop its slot.
func (w *world) retirePrimary(relay *harness.Process) {
	w.T.Helper()
	w.waitSettled(3 * time.Minute)
	w.waitProgressAt(w.ConfirmedFlush())
	if code, err := relay.Stop(time.Minute); err != nil || code != 0 {
		w.T.Fatalf("relay stop: exit %d, %v", code, err)
	}
	w.pg.Stop(w.T)
	w.T.Cleanup(func() { w.pg.Start(w.T) })
}

// TestDrillProgressRestoredBackup restores a base backup taken before the
// relay published anything (same system identifier, WAL that ends before
// the stored progress). The relay must refuse to start from a record that
// is ahead of the server, exit 1 and say why; with --reset-progress it must
// deliver every event written after the restore.
func TestDrillProgressRestoredBackup(t *testing.T) {
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{})
	w, _ := newKfakeWorld(t, pg)
	backup := pg.BaseBackup(t, false)

	relay := w.startRelay("--status-interval", "300ms")
	conn := w.connect()
	if err := w.writeTxns(conn, rng, 200, 10, 100); err != nil {
		t.Fatal(err)
	}
	w.retirePrimary(relay)

	backup.StartNew(t)
	r := w.on(backup)
	r.Migrate() // slots are not in base backups
	rconn := r.connect()
	if err := r.writeTxns(rconn, rng, 20, 10, 100); err != nil {
		t.Fatal(err)
	}
	refused := harness.StartProcess(t, r.Bin, r.args("run"), []string{harness.LogLevelInfo})
	code, err := refused.Wait(2 * time.Minute)
	if err != nil || code != 1 {
		t.Fatalf("relay on a restored backup with progress ahead exited %d (%v), want 1:\n%s", code, err, refused.Output())
	}
	for _, want := range []string{"progress record is ahead of this server", "restored from a backup", "--reset-progress"} {
		if !strings.Contains(refused.Output(), want) {
			t.Fatalf("the exit does not say %q:\n%s", want, tail(refused.Output(), 10))
		}
	}

	reset := harness.StartProcess(t, r.Bin, r.args("run", "--reset-progress"), []string{harness.LogLevelInfo})
	reset.WaitForOutput(t, harness.LogStreaming, 2*time.Minute)
	if !strings.Contains(reset.Output(), "--reset-progress: starting from the slot") {
		t.Fatalf("the reset is not logged:\n%s", tail(reset.Output(), 10))
	}
	if err := r.writeTxns(rconn, rng, 20, 10, 100); err != nil {
		t.Fatal(err)
	}
	ids, _ := r.Committed()
	harness.ConsumeEventIDs(t, r.Brokers, r.topicRegex(), ids, 2*time.Minute)
	t.Logf("all %d events written after the restore delivered", len(ids))
}

// TestDrillProgressPromotion fails over to a physical standby that stopped
// following the primary before the primary published more. The relay's
// record from the old primary lies past the point where the new primary's
// timeline branched off; taken at face value it would skip the new
// primary's first events (or stop the relay as "ahead"). The relay must use
// it only up to the branch point, log the orphaned range, and deliver every
// event written on the new primary.
func TestDrillProgressPromotion(t *testing.T) {
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{})
	w, _ := newKfakeWorld(t, pg)
	standby := pg.BaseBackup(t, true)
	standby.StartNew(t)

	relay := w.startRelay("--status-interval", "300ms")
	conn := w.connect()
	if err := w.writeTxns(conn, rng, 50, 10, 100); err != nil {
		t.Fatal(err)
	}
	primaryAt := w.DB.CurrentLSN(t)
	harness.WaitFor(t, time.Minute, "the standby replays the first events", func() bool {
		return harness.LSNAtMost(primaryAt, standby.QueryString(t, "SELECT coalesce(pg_last_wal_replay_lsn()::text, '')"))
	})
	standby.Stop(t)
	// The standby is gone: what follows exists only on the old primary.
	if err := w.writeTxns(conn, rng, 500, 10, 100); err != nil {
		t.Fatal(err)
	}
	w.retirePrimary(relay)
	oldLSN, oldTLI := storedProgress(t, w.Brokers, w.Slot)

	standby.Start(t)
	standby.Promote(t)
	n := w.on(standby)
	// PostgreSQL 15 has no failover slots. The slot's record came over
	// with the data, so migrate makes the slot only when told: every row
	// the standby has was published before it stopped following.
	n.Migrate("--existing-rows", "published")
	nconn := n.connect()
	// Write past the old record's LSN: taken at face value, the record
	// would then make the relay skip these events instead of stopping.
	for !harness.LSNAtMost(oldLSN, n.DB.CurrentLSN(t)) {
		if err := n.writeTxns(nconn, rng, 50, 10, 100); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("old primary's progress %s on timeline %d; new primary at %s with %d events", oldLSN, oldTLI, n.DB.CurrentLSN(t), n.CommittedCount())
	newRelay := n.startRelay("--status-interval", "300ms")
	if err := n.writeTxns(nconn, rng, 10, 10, 100); err != nil {
		t.Fatal(err)
	}
	ids, _ := n.Committed()
	harness.ConsumeEventIDs(t, n.Brokers, n.topicRegex(), ids, 2*time.Minute)
	if !strings.Contains(newRelay.Output(), "orphaned_from_lsn") {
		t.Fatalf("the orphaned WAL range of the old timeline is not logged:\n%s", tail(newRelay.Output(), 20))
	}
	n.waitSettled(2 * time.Minute)
	if lsn, tli := storedProgress(t, n.Brokers, n.Slot); tli != 2 {
		t.Fatalf("progress after the failover is %s on timeline %d, want timeline 2", lsn, tli)
	}
	t.Logf("all %d events of the new primary delivered", len(ids))
}

// TestDrillProgressTopicNotCreatable: the progress topic is missing and the
// broker refuses to create it (as for a user without Create). run must exit
// 1 with the command that creates it.
func TestDrillProgressTopicNotCreatable(t *testing.T) {
	w := newWorld(t, shared, nil)
	k := startKfake(t, harness.KfakeOptions{DisableAutoCreate: true}, w.topics())
	w.Brokers = k.Brokers()
	w.Migrate()
	harness.RefuseCreateTopics(k.Cluster())
	p := w.startRelayNoWait()
	code, err := p.Wait(2 * time.Minute)
	if err != nil || code != 1 {
		t.Fatalf("exit %d (%v), want 1:\n%s", code, err, p.Output())
	}
	want := "kafka-topics.sh --bootstrap-server " + k.BrokerList() + " --create --topic " + progressTopic + " --partitions 1 --replication-factor 1 --config cleanup.policy=compact"
	if !strings.Contains(p.Output(), want) {
		t.Fatalf("the error does not give the command %q:\n%s", want, tail(p.Output(), 5))
	}
}

// getJSON decodes the JSON document at url into v.
func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// A broker restart that came too soon after the relay created its progress
// topic left the relay looping on "read progress from outbox-relay.progress:
// find the partition's start: ... topic or partition that does not exist"
// for good: the store is opened once per process, so a progress topic that
// disappears is never made again. Here the topic is deleted while the relay
// streams, and the stream is restarted by ending its walsender. The relay
// must make the topic again, warn, start from the slot (the authority), and
// deliver what is committed afterwards.
func TestDrillProgressTopicMissingWhenTheStreamRestarts(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{})
	w, _ := newKfakeWorld(t, pg)
	rng := newRand(t)
	conn := w.connect()
	relay := w.startRelay()
	if err := w.writeTxns(conn, rng, 10, 3, 20); err != nil {
		t.Fatal(err)
	}
	w.waitSettled(time.Minute)
	w.waitProgressAt(w.ConfirmedFlush())

	harness.DeleteTopic(t, w.Brokers, progressTopic)
	streams := strings.Count(relay.Output(), harness.LogStreaming)
	pid := w.walsenderPID()
	w.DB.Exec(t, "SELECT pg_terminate_backend($1)", pid)
	if err := w.writeTxns(conn, rng, 10, 3, 20); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, time.Minute, "the relay streams again after its progress topic disappeared", func() bool {
		return relay.Exited() || strings.Count(relay.Output(), harness.LogStreaming) > streams
	})
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	w.checkDelivery(w.waitSettled(time.Minute))
	if !strings.Contains(relay.Output(), "progress topic was missing") {
		t.Fatalf("the relay did not warn that it made its progress topic again:\n%s", relay.Output())
	}
	w.waitProgressAt(w.ConfirmedFlush())
}

// TestDrillProgressTopicDeletedWhileStreaming deletes the progress topic
// under a streaming relay, with a writer committing about 100 events a
// second and no session restart. Before, every progress write failed
// until the stream happened to restart (OutboxRelayProgressNotWritten after
// ten minutes), and a PostgreSQL restart meanwhile re-delivered everything
// since the last record. The relay must make the topic again at its next
// write, say so, and store the position again; nothing is lost.
func TestDrillProgressTopicDeletedWhileStreaming(t *testing.T) {
	rng := newRand(t)
	w, _ := newKfakeWorld(t, shared)
	relay := w.startRelay()
	conn := w.connect()
	pw := startPacedWriter(w, conn, writerRand(rng), 50*time.Millisecond, 5, 200, false)
	defer pw.halt()
	w.waitProgressAt(w.ConfirmedFlush())

	harness.DeleteTopic(t, w.Brokers, progressTopic)
	deleted := time.Now()
	harness.WaitFor(t, time.Minute, "the relay makes its progress topic again", func() bool {
		return relay.Exited() || strings.Contains(relay.Output(), "made it again and wrote the current position")
	})
	if relay.Exited() {
		t.Fatalf("relay exited:\n%s", relay.Output())
	}
	remade := time.Since(deleted)
	if err := pw.halt(); err != nil {
		t.Fatal(err)
	}
	w.checkDelivery(w.waitSettled(time.Minute))
	w.waitProgressAt(w.ConfirmedFlush())
	t.Logf("progress topic deleted under a streaming relay: made again and written %v later, the stream never restarted (%d restarts); %d events, 0 lost",
		remade.Round(100*time.Millisecond), strings.Count(relay.Output(), msgRestart), w.CommittedCount())
}
