package poll_test

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/outbox-relay/outbox-relay/poll"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// drillBatch is the claim size in the drills.
const drillBatch = 50

// ackedUnmarked bounds the duplicates one killed poller can leave: the
// rows Kafka may have acked that it had not marked, its batch being marked
// and its batch publishing (a third, claimed and waiting, was never sent).
const ackedUnmarked = 2 * drillBatch

// world is a drill's database, broker, writer and pollers.
type world struct {
	*env
	rng     *mrand.Rand
	pollers []*harness.Process
	names   []string
}

func newWorld(t *testing.T, db *harness.PGDatabase) *world {
	t.Helper()
	w := &world{env: newEnvOn(t, db), rng: mrand.New(mrand.NewPCG(harness.DrillSeed(t), 0))}
	w.logClaims()
	return w
}

// logClaims records every change of a row's lease, with the lease it
// replaced, so checkLeases can prove no two pollers held one row at once.
// `at` is the changing transaction's now(), the time the claim's own
// lease check used. old_alive says whether the replaced lease's session
// still existed then: a lease is valid while unexpired and its session
// lives. The claim read the same snapshot of the server's sessions (one
// per transaction), so the two cannot disagree by a race. n orders the
// changes of one transaction.
func (w *world) logClaims() {
	w.DB.Exec(w.T, `CREATE TABLE claim_log (n bigserial, seq bigint, at timestamptz, claim bool,
		holder text, expires timestamptz, old_holder text, old_expires timestamptz, old_alive bool)`)
	w.DB.Exec(w.T, `CREATE FUNCTION log_claim() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO claim_log (seq, at, claim, holder, expires, old_holder, old_expires, old_alive)
			VALUES (NEW.seq, now(), NEW.attempts = OLD.attempts + 1,
				NEW.lease_holder, NEW.lease_expires_at, OLD.lease_holder, OLD.lease_expires_at,
				OLD.lease_pid IS NULL OR EXISTS (SELECT 1 FROM pg_stat_get_activity(OLD.lease_pid) a
					WHERE a.backend_start = OLD.lease_backend_start));
			RETURN NULL;
		END $$`)
	w.DB.Exec(w.T, `CREATE TRIGGER log_claim AFTER UPDATE ON outbox_events_poll FOR EACH ROW
		WHEN (OLD.lease_holder IS DISTINCT FROM NEW.lease_holder OR OLD.lease_expires_at IS DISTINCT FROM NEW.lease_expires_at)
		EXECUTE FUNCTION log_claim()`)
}

// checkLeases fails the test for every claim that took a row whose lease
// was still valid (unexpired, its session alive), and reports how many
// claims took a lease that had ended.
func (w *world) checkLeases() (claims, reclaimed int64) {
	w.T.Helper()
	const taken = "claim AND old_expires > at AND old_alive"
	if n := w.DB.QueryInt64(w.T, `SELECT count(*) FROM claim_log WHERE `+taken); n > 0 {
		sample := w.DB.QueryString(w.T, `SELECT string_agg(format('row %s claimed by %s at %s while %s held it until %s', seq, holder, at, old_holder, old_expires), '; ')
			FROM (SELECT * FROM claim_log WHERE `+taken+` LIMIT 5) x`)
		w.T.Errorf("%d claims took a row whose lease was still valid: %s", n, sample)
	}
	return w.DB.QueryInt64(w.T, "SELECT count(*) FROM claim_log WHERE claim"),
		w.DB.QueryInt64(w.T, "SELECT count(*) FROM claim_log WHERE claim AND old_holder IS NOT NULL")
}

// startPollers starts n pollers, each with an application_name that names
// its PostgreSQL sessions.
func (w *world) startPollers(n int, extra ...string) {
	for i := 0; i < n; i++ {
		w.names = append(w.names, fmt.Sprintf("poller-%d", i))
		w.pollers = append(w.pollers, nil)
		w.restart(i, extra...)
	}
}

func (w *world) restart(i int, extra ...string) {
	w.T.Helper()
	args := append([]string{"--poll-batch", fmt.Sprint(drillBatch)}, extra...)
	args = append(w.pollArgs(args...), "--pg-dsn", w.DB.DSN()+"&application_name="+w.names[i])
	p := harness.StartProcess(w.T, w.Bin, args, []string{harness.LogLevelInfo})
	p.WaitForOutput(w.T, `"message":"polling"`, time.Minute)
	w.pollers[i] = p
}

// writer commits small transactions over many aggregates from one
// connection until stopped, pacing itself with a ticker (load shape, not
// synchronisation). A commit whose outcome is unknown (the server died)
// is looked up by settle.
type writer struct {
	stop chan struct{}
	done chan error
	// prepare makes each transaction from now on two-phase: PREPARE
	// TRANSACTION, then COMMIT PREPARED, as an XA transaction manager does.
	prepare atomic.Bool
	doubt   struct {
		ids    []string
		events []harness.OutboxEvent
	}
}

func (w *world) startWriter(dsn string, every time.Duration, aggregates int) *writer {
	wr := &writer{stop: make(chan struct{}), done: make(chan error, 1)}
	rng := mrand.New(mrand.NewPCG(w.rng.Uint64(), 1))
	go func() {
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			wr.done <- err
			return
		}
		defer conn.Close(ctx)
		tick := time.NewTicker(every)
		defer tick.Stop()
		n := 0
		for {
			select {
			case <-wr.stop:
				wr.done <- nil
				return
			case <-tick.C:
			}
			events := make([]harness.OutboxEvent, 1+rng.IntN(5))
			for i := range events {
				events[i] = harness.NumberedEvent(n, rng.IntN(aggregates), fmt.Sprintf(`{"n": %d}`, n))
				n++
			}
			ids := make([]string, len(events))
			for i := range ids {
				ids[i] = harness.NewUUID()
			}
			commit := w.CommitIDs
			if wr.prepare.Load() {
				commit = w.commitPrepared
			}
			if err := commit(ctx, conn, ids, events); err != nil {
				wr.doubt.ids, wr.doubt.events = ids, events
				wr.done <- err
				return
			}
		}
	}()
	return wr
}

// commitPrepared commits the events in a two-phase transaction.
func (w *world) commitPrepared(ctx context.Context, conn *pgx.Conn, ids []string, events []harness.OutboxEvent) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	for i, e := range events {
		if _, err := tx.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, $3, $4, $5::jsonb)`,
			ids[i], e.AggregateType, e.AggregateID, e.EventType, e.Payload); err != nil {
			return err
		}
	}
	gid := "drill-" + ids[0]
	if _, err := tx.Exec(ctx, "PREPARE TRANSACTION '"+gid+"'"); err != nil {
		return fmt.Errorf("prepare: %w", err)
	}
	if _, err := conn.Exec(ctx, "COMMIT PREPARED '"+gid+"'"); err != nil {
		return fmt.Errorf("commit prepared: %w", err)
	}
	w.Record(ids, events)
	return nil
}

// halt stops the writer and returns the error it stopped on, if any.
func (wr *writer) halt() error {
	close(wr.stop)
	return <-wr.done
}

// settle records the in-doubt transaction if it committed.
func (wr *writer) settle(w *world) {
	w.T.Helper()
	if len(wr.doubt.ids) == 0 {
		return
	}
	switch n := w.DB.QueryInt64(w.T, "SELECT count(*) FROM outbox_events WHERE event_id = ANY($1::uuid[])", wr.doubt.ids); n {
	case int64(len(wr.doubt.ids)):
		w.Record(wr.doubt.ids, wr.doubt.events)
	case 0:
	default:
		w.T.Fatalf("%d of the %d rows of the in-doubt transaction exist: a transaction is atomic", n, len(wr.doubt.ids))
	}
}

// finish checks the drill's promises once everything is published: no
// loss, per-aggregate order of first delivery, duplicates within bound,
// and no lease ever taken while valid.
func (w *world) finish(maxDuplicates int) {
	w.T.Helper()
	harness.WaitFor(w.T, 3*time.Minute, "every row published", func() bool { return w.unpublished() == 0 })
	records := w.ConsumeAll(3 * time.Minute)
	dups := len(records) - w.CommittedCount()
	claims, reclaimed := w.checkLeases()
	w.T.Logf("%d events, %d records (%d duplicates, bound %d); %d claims, %d of rows whose lease had expired",
		w.CommittedCount(), len(records), dups, maxDuplicates, claims, reclaimed)
	if dups > maxDuplicates {
		w.T.Errorf("%d duplicates, over the bound of %d", dups, maxDuplicates)
	}
	for i, p := range w.pollers {
		if p.Exited() {
			w.T.Errorf("poller %d exited:\n%s", i, p.Output())
		}
	}
}

// Three pollers share one table while a writer commits across many
// aggregates, and pollers are SIGKILLed at random moments and restarted.
// Once, the kill lands between Kafka's ack and the mark: marks are held at
// a lock the test owns until the killed poller's session is gone. Its
// rows' leases end with its session; another poller publishes them again.
func TestDrillPollThreePollersKilled(t *testing.T) {
	w := newWorld(t, cluster.CreateTestDatabase(t))
	// A session whose client died notices while it waits for a lock, so
	// the held mark of a killed poller never commits.
	w.DB.Exec(t, fmt.Sprintf("ALTER DATABASE %s SET client_connection_check_interval = '100ms'", pgx.Identifier{w.DB.Name()}.Sanitize()))
	w.DB.Exec(t, `CREATE FUNCTION hold_marks() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NEW; END $$`)
	w.DB.Exec(t, `CREATE TRIGGER hold_marks BEFORE UPDATE ON outbox_events_poll FOR EACH ROW
		WHEN (OLD.published_at IS NULL AND NEW.published_at IS NOT NULL) EXECUTE FUNCTION hold_marks()`)

	w.startPollers(3)
	wr := w.startWriter(w.DB.DSN(), 5*time.Millisecond, 300)
	kills := 0

	// The kill between ack and mark.
	lock := w.DB.Connect(t)
	ctx := context.Background()
	if _, err := lock.Exec(ctx, "SELECT pg_advisory_lock(4242)"); err != nil {
		t.Fatal(err)
	}
	var victim string
	harness.WaitFor(t, time.Minute, "a poller's mark waits at the lock", func() bool {
		victim = w.DB.QueryString(t, `SELECT COALESCE(min(application_name), '') FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND application_name LIKE 'poller-%'`)
		return victim != ""
	})
	var i int
	fmt.Sscanf(victim, "poller-%d", &i)
	// Its batch, acked and waiting at the lock to be marked: the mark
	// cannot commit before the lock is released, so these rows are
	// unmarked at the kill, and its session's end frees them.
	held := w.DB.QueryString(t, `SELECT COALESCE(string_agg(seq::text, ',' ORDER BY seq), '') FROM outbox_events_poll
		WHERE lease_holder LIKE '%:' || $1 AND published_at IS NULL`, fmt.Sprint(w.pollers[i].Pid()))
	w.pollers[i].Kill()
	kills++
	harness.WaitFor(t, time.Minute, "the killed poller's session ends", func() bool {
		return w.DB.QueryInt64(t, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", victim) == 0
	})
	unmarked := int64(len(strings.Split(held, ",")))
	if held == "" {
		unmarked = 0
	}
	if _, err := lock.Exec(ctx, "SELECT pg_advisory_unlock(4242)"); err != nil {
		t.Fatal(err)
	}
	t.Logf("killed %s between ack and mark with %d rows of its batch acked and unmarked", victim, unmarked)
	if unmarked == 0 {
		t.Fatalf("the killed poller %s held no unmarked rows: the kill did not land between ack and mark", victim)
	}
	w.restart(i)

	// Random kills while the writer writes.
	for range harness.Sized(5, 20) {
		d := time.Duration(300+w.rng.IntN(1200)) * time.Millisecond
		time.Sleep(d) // the drill's random gap between kills: a load shape, not a wait for anything
		i := w.rng.IntN(len(w.pollers))
		w.pollers[i].Kill()
		kills++
		w.restart(i)
	}
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 3*time.Minute, "the batch killed between ack and mark is published again", func() bool {
		return w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE seq = ANY(string_to_array($1, ',')::bigint[]) AND published_at IS NULL", held) == 0
	})
	w.finish(kills * ackedUnmarked)
}

// Kafka refuses every produce request for a while (NOT_LEADER, retriable)
// while the writer goes on: events back off one by one and are all
// published once it is back, in order, with nothing quarantined.
func TestDrillPollBrokerOutage(t *testing.T) {
	w := newWorld(t, cluster.CreateTestDatabase(t))
	w.startPollers(2, "--max-attempts", "1000")
	wr := w.startWriter(w.DB.DSN(), 10*time.Millisecond, 100)
	harness.WaitFor(t, time.Minute, "events flow before the outage", func() bool {
		return w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE published_at IS NOT NULL") > 200
	})
	fault := w.Kafka.FailProduce(-1, kerr.NotLeaderForPartition.Code)
	outage := time.Duration(harness.Sized(8, 30)) * time.Second
	time.Sleep(outage) // the outage's length: a deliberate fault duration
	backing := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE published_at IS NULL AND attempts > 0")
	fault.Remove()
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	t.Logf("outage of %v: %d rows had failed attempts; %d produce requests refused", outage, backing, fault.Hits())
	if fault.Hits() == 0 || backing == 0 {
		t.Fatalf("the outage refused %d requests and left %d rows with failed attempts: it did not happen", fault.Hits(), backing)
	}
	w.finish(0)
	if n := w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine"); n != 0 {
		t.Errorf("%d events quarantined by a retriable outage", n)
	}
}

// PostgreSQL stops with -m immediate under load and starts again: pollers
// reconnect, and every committed event arrives, in order.
func TestDrillPollPostgresImmediateRestart(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{})
	db := pg.CreateTestDatabase(t)
	w := newWorld(t, db)
	w.startPollers(2)
	wr := w.startWriter(db.DSN(), 5*time.Millisecond, 100)
	harness.WaitFor(t, time.Minute, "events flow before the crash", func() bool {
		return w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE published_at IS NOT NULL") > 300
	})
	pg.StopImmediate(t)
	werr := wr.halt()
	pg.Start(t)
	wr.settle(w)
	t.Logf("PostgreSQL crashed with %d events committed (writer stopped on: %v)", w.CommittedCount(), werr)
	harness.WaitFor(t, 2*time.Minute, "the pollers poll again", func() bool {
		for _, p := range w.pollers {
			if strings.Count(p.Output(), `"message":"polling"`) < 2 {
				return false
			}
		}
		return true
	})
	before := w.CommittedCount()
	wr = w.startWriter(db.DSN(), 5*time.Millisecond, 100)
	harness.WaitFor(t, time.Minute, "events written after the restart", func() bool { return w.CommittedCount() > before+200 })
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	// A poller killed by the crash mid-batch leaves nothing leased: its
	// session ended, and the next one freed its own leases at once.
	w.finish(2 * ackedUnmarked)
}

// Issue 30's drill: three pollers with their default worker ids (host:pid,
// so a restarted poller never has its old leases back by name) and the
// default --poll-lease, a writer across many aggregates, and SIGKILLs with
// restarts, as systemd would do them. Every row a killed poller held is
// published again, by another poller or its restart, within 5 s of the
// kill: its leases end with its PostgreSQL session, not after --poll-lease.
// Full size: 20,000 events at about 2,000/s and 6 kills.
func TestDrillPollKilledPollersLeasesEndWithTheirSession(t *testing.T) {
	const bound = 5 * time.Second
	w := newWorld(t, cluster.CreateTestDatabase(t))
	// Acks as slow as a real broker's keep each poller's batch in flight,
	// so a kill at a random moment mostly finds it holding rows.
	w.Kafka.DelayProduce(20 * time.Millisecond)
	lease := "--poll-lease=" + poll.DefaultConfig().Lease.String()
	w.startPollers(3, lease)
	// 1 to 5 events per tick: about 600 events/s reduced, 2,000 full.
	wr := w.startWriter(w.DB.DSN(), time.Duration(harness.Sized(5000, 1500))*time.Microsecond, 300)
	events, measure := harness.Sized(3000, 20000), harness.Sized(3, 6)
	kills := 0
	var worst time.Duration
	for measured := 0; measured < measure; {
		if kills >= 3*measure {
			t.Fatalf("%d kills, only %d of them left rows to the other pollers", kills, measured)
		}
		time.Sleep(time.Duration(300+w.rng.IntN(1200)) * time.Millisecond) // the drill's random gap between kills: a load shape
		i := w.rng.IntN(len(w.pollers))
		pid := fmt.Sprint(w.pollers[i].Pid())
		harness.WaitFor(t, 30*time.Second, "the poller to kill holds leased rows", func() bool {
			return w.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE lease_holder LIKE '%:' || $1 AND published_at IS NULL", pid) > 0
		})
		// The host's clock, which PostgreSQL's published_at also reads,
		// taken before the kill: rows others publish again within the
		// moment the kill takes are counted too.
		killedAt := time.Now()
		w.pollers[i].Kill()
		kills++
		// What it held at its death: rows it claimed and had not marked
		// before the kill. Whoever publishes them marks them, after
		// Kafka's ack.
		const held = `FROM outbox_events_poll s WHERE s.seq IN (SELECT seq FROM claim_log WHERE claim AND holder LIKE '%:' || $1)
			AND (s.published_at IS NULL OR s.published_at > $2::timestamptz)`
		rows := w.DB.QueryInt64(t, "SELECT count(*) "+held, pid, killedAt)
		// Of those, the rows another poller claimed from it: what the
		// kill left for the others, rather than what it marked itself
		// in its last moment.
		reclaimed := w.DB.QueryInt64(t, "SELECT count(*) "+held+
			" AND s.seq IN (SELECT seq FROM claim_log WHERE claim AND old_holder LIKE '%:' || $1 AND holder NOT LIKE '%:' || $1)", pid, killedAt)
		published := harness.Poll(bound+5*time.Second, func() bool {
			return w.DB.QueryInt64(t, "SELECT count(*) "+held+" AND s.published_at IS NULL", pid, killedAt) == 0
		})
		if !published {
			t.Fatalf("kill %d (%s): %d of the %d rows it held are still unpublished %v after the kill: their leases outlived the poller",
				kills, w.names[i], w.DB.QueryInt64(t, "SELECT count(*) "+held+" AND s.published_at IS NULL", pid, killedAt), rows, bound+5*time.Second)
		}
		delay := time.Duration(w.DB.QueryInt64(t, "SELECT COALESCE((extract(epoch FROM max(s.published_at) - $2::timestamptz) * 1e6)::bigint, 0) "+held,
			pid, killedAt)) * time.Microsecond
		t.Logf("kill %d (%s): %d rows unmarked, %d of them claimed by another poller; all published within %v of the kill",
			kills, w.names[i], rows, reclaimed, delay.Round(time.Millisecond))
		if reclaimed > 0 {
			measured++
			worst = max(worst, delay)
			if delay > bound {
				t.Errorf("kill %d: the rows %s held were published again %v after the kill, over %v", kills, w.names[i], delay, bound)
			}
		}
		w.restart(i, lease)
	}
	harness.WaitFor(t, 5*time.Minute, fmt.Sprintf("%d events written", events), func() bool { return w.CommittedCount() >= events })
	if err := wr.halt(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d kills, %d that left rows to the others; the longest wait from a kill to its rows' publication: %v", kills, measure, worst.Round(time.Millisecond))
	w.finish(kills * ackedUnmarked)
}
