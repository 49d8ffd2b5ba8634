package pattern

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

const (
	partitions = 6
	group      = "ledger"
)

// TestDrillWriterRelayInbox is the end-to-end drill of the pattern. A
// writer commits business rows (an account's version) and their events
// through package outbox over many aggregates, and rolls back one
// transaction in eight after writing its events. The relay is SIGKILLed
// several times, with a PostgreSQL immediate shutdown and restart after
// every other kill. Two consumer processes in one group apply the events
// through package inbox, with version checks, into a side-effect table,
// and each is SIGKILLed mid-stream several times. At the end the side-effect
// table must hold every committed event exactly once, in per-aggregate
// version order, and nothing of a rolled-back transaction; the consumers
// must have skipped duplicates, so the dedupe path ran. The consumers' handler
// fails its first attempt at one event in 40: some of those failures land
// in the middle of a batch, which must be rolled back and applied again one
// event at a time without applying anything twice or out of order.
//
// Reduced: 3,000 events over 100 aggregates, 3 relay kills, 2 kills of each
// consumer; OUTBOX_RELAY_DRILL_SIZE=full: 30,000 events over 1,000
// aggregates, 8 relay kills, 5 kills of each consumer. It runs once with
// the relay at least once and once with --delivery exactly-once (the
// consumers then read with read_committed).
func TestDrillWriterRelayInbox(t *testing.T) {
	for _, mode := range []struct {
		name          string
		relayArgs     []string
		readCommitted bool
	}{
		{"at-least-once", nil, false},
		{"exactly-once", []string{"--delivery", "exactly-once", "--transaction-interval", "50ms"}, true},
	} {
		t.Run(mode.name, func(t *testing.T) {
			d := drill{
				events: harness.Sized(3_000, 30_000), aggregates: harness.Sized(100, 1_000),
				relayKills: harness.Sized(3, 8), consumerKills: harness.Sized(2, 5),
				relayArgs: mode.relayArgs, readCommitted: mode.readCommitted,
				restartPostgres: true, settleWithin: 5 * time.Minute,
			}
			d.run(t)
		})
	}
}

// TestDrillGroupRejoins is the drill on Apache Kafka with the consumers'
// group under churn. A group coordinator holds a JoinGroup answer until the
// rebalance ends: a rebalance that waits for a SIGKILLed member can outlast
// a client's read timeout, and members that retry can keep the group
// rebalancing for good. The consumers use exactly the settings
// docs/inbox.md gives (inboxsarama.NewConfig,
// inboxsarama.NewConsumerGroup); every committed event must be applied
// exactly once within two minutes of the writer's last commit. Every other
// time a consumer is killed, the other one is killed with it.
//
// Reduced: 2,000 events over 100 aggregates, 2 relay kills, 4 consumer
// rounds (6 consumer kills); OUTBOX_RELAY_DRILL_SIZE=full: 10,000 events
// over 500 aggregates, 5 relay kills, 8 consumer rounds (12 kills).
func TestDrillGroupRejoins(t *testing.T) {
	d := drill{
		events: harness.Sized(2_000, 10_000), aggregates: harness.Sized(100, 500),
		relayKills: harness.Sized(2, 5), consumerKills: harness.Sized(2, 4),
		apacheKafka: true, killTogether: true, settleWithin: 2 * time.Minute,
	}
	d.run(t)
}

type drill struct {
	events, aggregates, relayKills, consumerKills int
	relayArgs                                     []string
	readCommitted                                 bool
	// apacheKafka runs the drill on Apache Kafka instead of kfake.
	apacheKafka bool
	// restartPostgres shuts PostgreSQL down immediately and starts it
	// again after every other relay kill.
	restartPostgres bool
	// killTogether kills both consumers at once in every other consumer
	// round.
	killTogether bool
	// settleWithin bounds the wait, after the writer's last commit, for
	// every committed event to be applied.
	settleWithin time.Duration
}

// ledger is what the writer committed, in commit order, which per
// aggregate is version order (one goroutine writes), and what it rolled
// back.
type ledger struct {
	*harness.Ledger
	mu        sync.Mutex
	aborted   []string
	abortedTx int
}

func (l *ledger) commit(ids, aggs []string) {
	events := make([]harness.OutboxEvent, len(ids))
	for i := range events {
		events[i].AggregateID = aggs[i]
	}
	l.Record(ids, events)
}

func (l *ledger) abort(ids []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.aborted = append(l.aborted, ids...)
	l.abortedTx++
}

func (d drill) run(t *testing.T) {
	began := time.Now()
	rng := mrand.New(mrand.NewPCG(harness.DrillSeed(t), 1))

	pg := harness.StartPostgres(t, harness.PGOptions{})
	db := pg.CreateTestDatabase(t)
	relayBin := harness.BuildRelay(t)
	consumerBin := harness.BuildProgram(t, "./test/pattern/consumer")
	slot := db.Name()
	harness.Migrate(t, relayBin, harness.RelayFlags{DSN: db.DSN(), Slot: slot}.Args("migrate"))
	ddl, err := inbox.SQL(inbox.Tables{})
	if err != nil {
		t.Fatal(err)
	}
	db.Exec(t, ddl)
	db.Exec(t, `CREATE TABLE accounts (id text PRIMARY KEY, version bigint NOT NULL)`)
	db.Exec(t, `INSERT INTO accounts SELECT 'acct-' || i, 0 FROM generate_series(1, $1::int) i`, d.aggregates)
	db.Exec(t, `CREATE TABLE effects (seq bigserial PRIMARY KEY, consumer text NOT NULL, event_id text NOT NULL,
		aggregate_id text NOT NULL, version bigint NOT NULL, pid int NOT NULL)`)

	// The database's name is the test's, so a topic on a shared Apache
	// Kafka cluster is the test's own.
	topicPrefix := "pattern." + db.Name() + "."
	topic := topicPrefix + "account"
	var brokers []string
	if d.apacheKafka {
		k := harness.RequireApacheKafka(t, harness.ApacheKafkaOptions{})
		if err := k.CreateTopic(topic, partitions, 1, nil); err != nil {
			t.Fatalf("%v%s", err, k.LogTail(0, 30))
		}
		brokers = k.Brokers()
	} else {
		k := harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: partitions})
		k.CreateTopic(t, topic, partitions, nil)
		brokers = k.Brokers()
	}

	// The writer commits one chunk per round, so writing spans the kills.
	l := &ledger{Ledger: harness.NewLedger()}
	rounds := max(d.relayKills, 2*d.consumerKills)
	chunk := d.events / (rounds + 1)
	chunks := make(chan int, rounds+1)
	writerRng := mrand.New(mrand.NewPCG(rng.Uint64(), 2))
	writerDone := make(chan error, 1)
	go func() { writerDone <- write(db.DSN(), writerRng, d.aggregates, chunks, l) }()
	waitWriter := sync.OnceValue(func() error { return <-writerDone })
	closeChunks := sync.OnceFunc(func() { close(chunks) })
	defer func() {
		closeChunks()
		waitWriter()
	}()

	relayArgs := harness.RelayFlags{DSN: db.DSN(), Slot: slot, Brokers: brokers, Topic: topicPrefix + "{aggregate_type}"}.
		Args("run", d.relayArgs...)
	startRelay := func() *harness.Process {
		return harness.StartProcess(t, relayBin, relayArgs, []string{harness.LogLevelInfo})
	}
	consumerArgs := []string{"--brokers", strings.Join(brokers, ","), "--dsn", db.DSN(), "--group", group, "--topic", topic,
		"--read-committed=" + strconv.FormatBool(d.readCommitted), "--fail-first-attempt-every", "40"}
	var lives []*harness.Process // every consumer life, for its counters
	startConsumer := func() *harness.Process {
		p := harness.StartProcess(t, consumerBin, consumerArgs, nil)
		lives = append(lives, p)
		return p
	}
	kafkaRecords := func() int64 {
		var n int64
		for _, o := range harness.EndOffsets(t, brokers, topic) {
			n += o
		}
		return n
	}
	applied := func() int64 { return db.QueryInt64(t, `SELECT count(*) FROM effects`) }

	chunks <- chunk
	relay := startRelay()
	consumers := [2]*harness.Process{startConsumer(), startConsumer()}
	pgRestarts, consumerKillsDone := 0, 0
	for round := 0; round < rounds; round++ {
		chunks <- chunk
		if round < d.relayKills {
			// Kill once the relay has published a random share of a chunk
			// in this life: mid-stream, with acknowledgements in flight.
			from, target := kafkaRecords(), int64(1+rng.IntN(max(chunk/2, 1)))
			harness.WaitFor(t, 2*time.Minute, fmt.Sprintf("relay life %d publishes %d records", round+1, target), func() bool {
				return relay.Exited() || kafkaRecords()-from >= target
			})
			if relay.Exited() {
				t.Fatalf("relay exited on its own:\n%s", harness.LastLines(relay.Output(), 30))
			}
			relay.Kill()
			if d.restartPostgres && round%2 == 0 {
				pg.StopImmediate(t)
				pg.Start(t)
				pgRestarts++
			}
			relay = startRelay()
		}
		if round < 2*d.consumerKills {
			// Kill one consumer while it applies records: some of what it
			// committed to the database has no offset committed yet.
			victim := round % 2
			from, target := applied(), int64(1+rng.IntN(max(chunk/3, 1)))
			if !harness.Poll(2*time.Minute, func() bool { return consumers[victim].Exited() || applied()-from >= target }) {
				t.Fatalf("the consumers applied %d of %d more events in 2m0s (%d events committed, %d applied); %s; "+
					"end offsets %v, the group's committed offsets %v", applied()-from, target, l.CommittedCount(), applied(),
					sessionErrors(lives), harness.EndOffsets(t, brokers, topic), harness.CommittedOffsets(t, brokers, group, topic))
			}
			if consumers[victim].Exited() {
				t.Fatalf("consumer exited on its own:\n%s", harness.LastLines(consumers[victim].Output(), 30))
			}
			consumers[victim].Kill()
			consumerKillsDone++
			if d.killTogether && round%2 == 1 {
				// Both at once, as a host or a deployment takes them:
				// the group has only dead members until the new ones join.
				consumers[1-victim].Kill()
				consumerKillsDone++
				consumers[1-victim] = startConsumer()
			}
			consumers[victim] = startConsumer()
		}
		t.Logf("round %d: %d events committed, %d records in Kafka, %d effects", round+1, l.CommittedCount(), kafkaRecords(), applied())
	}
	chunks <- d.events - (rounds+1)*chunk
	closeChunks()
	if err := waitWriter(); err != nil {
		t.Fatalf("writer: %v", err)
	}

	committed, order := l.Committed()
	settling := time.Now()
	appliedOfCommitted := func() int64 {
		return db.QueryInt64(t, `SELECT count(DISTINCT event_id) FROM effects WHERE event_id = ANY($1)`, committed)
	}
	if !harness.Poll(d.settleWithin, func() bool {
		if relay.Exited() {
			t.Fatalf("relay exited on its own:\n%s", harness.LastLines(relay.Output(), 30))
		}
		return appliedOfCommitted() == int64(len(committed))
	}) {
		t.Fatalf("%v after the writer's last commit, %d of %d committed events applied (%d records in Kafka); %s; "+
			"end offsets %v, the group's committed offsets %v",
			d.settleWithin, appliedOfCommitted(), len(committed), kafkaRecords(), sessionErrors(lives),
			harness.EndOffsets(t, brokers, topic), harness.CommittedOffsets(t, brokers, group, topic))
	}
	t.Logf("every committed event applied %v after the writer's last commit", time.Since(settling).Round(100*time.Millisecond))
	for _, c := range consumers {
		if err := c.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if code, err := c.Wait(time.Minute); err != nil || code != 0 {
			t.Fatalf("consumer stopped with %d, %v:\n%s", code, err, harness.LastLines(c.Output(), 30))
		}
	}

	// Exactly once: no event's effect twice, nothing rolled back applied.
	if n := db.QueryInt64(t, `SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY event_id HAVING count(*) > 1) twice`); n != 0 {
		t.Errorf("%d events applied more than once", n)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM effects WHERE event_id = ANY($1)`, l.aborted); n != 0 {
		t.Errorf("%d effects of rolled-back transactions", n)
	}
	if n := db.QueryInt64(t, `SELECT count(*) FROM effects`); n != int64(len(committed)) {
		t.Errorf("%d effects for %d committed events", n, len(committed))
	}
	// Per-aggregate order: each aggregate's effects, in the order they were
	// applied, are its events in version order.
	rows, err := db.Connect(t).Query(context.Background(), `SELECT aggregate_id, event_id, version FROM effects ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]string{}
	for rows.Next() {
		var agg, id string
		var version int64
		if err := rows.Scan(&agg, &id, &version); err != nil {
			t.Fatal(err)
		}
		if want := int64(len(got[agg]) + 1); version != want {
			t.Errorf("%s: version %d applied as its #%d effect", agg, version, want)
		}
		got[agg] = append(got[agg], id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for agg, ids := range order {
		if strings.Join(got[agg], ",") != strings.Join(ids, ",") {
			t.Errorf("%s: applied %d events in an order other than committed (%d events)", agg, len(got[agg]), len(ids))
		}
	}

	// What the consumers counted, each life up to its last line.
	var sum inbox.Counts
	var injected int64
	for _, p := range lives {
		c := lastCounts(p.Output())
		injected += c.InjectedFailures
		sum.Applied += c.Applied
		sum.Duplicates += c.Duplicates
		sum.StaleVersions += c.StaleVersions
		sum.VersionGaps += c.VersionGaps
		sum.HandlerErrors += c.HandlerErrors
	}
	if sum.Duplicates+sum.StaleVersions == 0 {
		t.Errorf("the consumers skipped no duplicate: the dedupe path never ran")
	}
	// A failure the handler's error count does not show was absorbed: it
	// failed inside a batch, which was rolled back and applied again one
	// event at a time.
	if injected <= sum.HandlerErrors {
		t.Errorf("%d handler failures injected, %d reported as errors: none happened in the middle of a batch", injected, sum.HandlerErrors)
	}
	records := kafkaRecords()
	t.Logf("%d events committed over %d aggregates (%d events in %d rolled-back transactions), %d Kafka offsets used; "+
		"%d relay kills, %d PostgreSQL immediate restarts, %d consumer kills; consumers counted %d applied, %d duplicates skipped "+
		"(%d by version), %d version gaps, %d handler errors (%d failures injected); %s; 0 effects applied twice; %v",
		len(committed), d.aggregates, len(l.aborted), l.abortedTx, records, d.relayKills, pgRestarts, consumerKillsDone,
		sum.Applied, sum.Duplicates, sum.StaleVersions, sum.VersionGaps, sum.HandlerErrors, injected, sessionErrors(lives), time.Since(began).Round(time.Second))
}

// sessionErrors counts the group sessions the consumers' lives saw end in
// an error (the consumer joins its group again after each), with the last
// one's message.
func sessionErrors(lives []*harness.Process) string {
	n, last := 0, ""
	for _, p := range lives {
		for _, line := range strings.Split(p.Output(), "\n") {
			if strings.Contains(line, "joining the group again") {
				n, last = n+1, line
			}
		}
	}
	if n == 0 {
		return "no group session ended in an error"
	}
	return fmt.Sprintf("%d group sessions ended in an error, the last: %s", n, last)
}

// consumerCounts is a consumer's counter line.
type consumerCounts struct {
	inbox.Counts
	InjectedFailures int64
}

// lastCounts is the last counter line a consumer life printed.
func lastCounts(out string) consumerCounts {
	var c consumerCounts
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if err := json.Unmarshal([]byte(lines[i]), &c); err == nil && strings.HasPrefix(lines[i], `{"Applied"`) {
			return c
		}
	}
	return consumerCounts{}
}

// write is the service: each transaction bumps the version of one to three
// accounts and writes one event per bump with the outbox writer, and one
// transaction in eight is rolled back after writing. It survives
// PostgreSQL restarts: a transaction that fails is rolled back, and one
// whose COMMIT got no answer is looked up after reconnecting.
func write(dsn string, rng *mrand.Rand, aggregates int, chunks <-chan int, l *ledger) error {
	ctx := context.Background()
	w, err := outbox.New("")
	if err != nil {
		return err
	}
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(ctx)
		}
	}()
	reconnect := func() error {
		if conn != nil {
			conn.Close(ctx)
			conn = nil
		}
		deadline := time.Now().Add(2 * time.Minute)
		for {
			c, err := pgx.Connect(ctx, dsn)
			if err == nil {
				conn = c
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("reconnect: %w", err)
			}
			time.Sleep(50 * time.Millisecond) // retry pacing, not synchronisation
		}
	}
	if err := reconnect(); err != nil {
		return err
	}
	for n := range chunks {
		for n > 0 {
			size := min(n, 1+rng.IntN(3))
			ids := make([]string, size)
			aggs := make([]string, size)
			for i := range ids {
				ids[i] = outbox.NewID()
				aggs[i] = fmt.Sprintf("acct-%d", 1+rng.IntN(aggregates))
			}
			rollback := rng.IntN(8) == 0
			outcome, err := writeTxn(ctx, conn, w, ids, aggs, rollback)
			if err != nil {
				if err := reconnect(); err != nil {
					return err
				}
				if outcome == inDoubt {
					var found int
					if err := conn.QueryRow(ctx, `SELECT count(*) FROM outbox_events WHERE event_id = ANY($1::uuid[])`, ids).Scan(&found); err != nil {
						return fmt.Errorf("look up a transaction in doubt: %w", err)
					}
					if found == size {
						outcome = committed
					} else if found == 0 {
						outcome = aborted
					} else {
						return fmt.Errorf("%d of %d events of one transaction committed", found, size)
					}
				}
			}
			switch outcome {
			case committed:
				l.commit(ids, aggs)
				n -= size
			case aborted:
				l.abort(ids)
			}
		}
	}
	return nil
}

type txnOutcome int

const (
	committed txnOutcome = iota
	aborted
	inDoubt
)

func writeTxn(ctx context.Context, conn *pgx.Conn, w *outbox.Writer, ids, aggs []string, rollback bool) (txnOutcome, error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return aborted, err
	}
	defer tx.Rollback(ctx)
	events := make([]outbox.Event, len(ids))
	for i := range ids {
		var version int64
		if err := tx.QueryRow(ctx, `UPDATE accounts SET version = version + 1 WHERE id = $1 RETURNING version`, aggs[i]).Scan(&version); err != nil {
			return aborted, err
		}
		events[i] = outbox.Event{ID: ids[i], AggregateType: "account", AggregateID: aggs[i], EventType: "Bumped",
			Payload: fmt.Appendf(nil, `{"version": %d}`, version), AggregateVersion: version}
	}
	if _, err := w.Write(ctx, tx, events...); err != nil {
		return aborted, err
	}
	if rollback {
		return aborted, tx.Rollback(ctx)
	}
	if err := tx.Commit(ctx); err != nil {
		if errors.Is(err, pgx.ErrTxCommitRollback) {
			return aborted, err
		}
		return inDoubt, err
	}
	return committed, nil
}
