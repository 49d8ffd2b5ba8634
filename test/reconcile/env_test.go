// Package reconcile_test drives `outbox-relay reconcile` against a real
// PostgreSQL and an in-process Kafka (kfake), and checks what it reports
// and repairs with an independent franz-go consumer.
package reconcile_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

var cluster *harness.Postgres

func TestMain(m *testing.M) {
	harness.MainWithPostgres(m, harness.PGOptions{}, func(pg *harness.Postgres) { cluster = pg })
}

const partitions = 4

// env is one test's world: its own database, slot and Kafka cluster.
type env struct {
	t     *testing.T
	db    *harness.PGDatabase
	kafka *harness.Kfake
	bin   string
	slot  string
	conn  *pgx.Conn
	*harness.Ledger
}

func newEnv(t *testing.T) *env {
	t.Helper()
	db, slot := cluster.CreateRelayDatabase(t)
	return &env{t: t, db: db, bin: harness.BuildRelay(t), slot: slot, Ledger: harness.NewLedger(),
		kafka: harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: partitions})}
}

// command is a command line: the command, the database, slot and (but
// for migrate) Kafka, then extra.
func (e *env) command(name string, extra ...string) []string {
	flags := harness.RelayFlags{DSN: e.db.DSN(), Slot: e.slot, Brokers: e.kafka.Brokers()}
	if name != "migrate" && name != "run" {
		extra = append([]string{"--kafka-brokers", e.kafka.BrokerList()}, extra...)
	}
	return flags.Args(name, extra...)
}

func (e *env) migrate(extra ...string) {
	e.t.Helper()
	harness.Migrate(e.t, e.bin, e.command("migrate", extra...))
}

func (e *env) startRelay(extra ...string) *harness.Process {
	e.t.Helper()
	return harness.StartStreaming(e.t, e.bin, e.command("run", extra...))
}

func (e *env) stopRelay(p *harness.Process) {
	e.t.Helper()
	if code, err := p.Stop(time.Minute); err != nil || code != 0 {
		e.t.Fatalf("relay exited %d (%v) on SIGTERM", code, err)
	}
}

// commit writes n single-event transactions for aggregateType and returns
// their ids.
func (e *env) commit(n int, aggregateType string) []string {
	e.t.Helper()
	if e.conn == nil {
		conn, err := pgx.Connect(context.Background(), e.db.DSN())
		if err != nil {
			e.t.Fatalf("connect: %v", err)
		}
		e.t.Cleanup(func() { conn.Close(context.Background()) })
		e.conn = conn
	}
	before := e.CommittedCount()
	for i := 0; i < n; i++ {
		ev := harness.OutboxEvent{AggregateType: aggregateType, AggregateID: fmt.Sprintf("%s-%d", aggregateType, i%3),
			EventType: "Happened", Payload: fmt.Sprintf(`{"n": %d}`, before+i)}
		if i%2 == 0 {
			ev.Headers = `{"tenant": "acme"}`
		}
		if err := e.Commit(context.Background(), e.conn, []harness.OutboxEvent{ev}); err != nil {
			e.t.Fatalf("commit: %v", err)
		}
	}
	ids, _ := e.Committed()
	return ids[before:]
}

// consumeAll waits until the independent consumer has every id.
func (e *env) consumeAll(ids []string) []harness.Record {
	e.t.Helper()
	records := harness.ConsumeEventIDs(e.t, e.kafka.Brokers(), `^outbox\.event\.`, ids, time.Minute)
	harness.CheckNoLoss(e.t, records, ids)
	return records
}

// report is the part of `reconcile --json` the tests read.
type report struct {
	RowsChecked          int64    `json:"rows_checked"`
	Found                int64    `json:"found"`
	Missing              []string `json:"missing"`
	Duplicated           []string `json:"delivered_more_than_once"`
	Quarantined          []string `json:"quarantined"`
	Republished          int64    `json:"republished"`
	RepublishQuarantined []string `json:"republish_quarantined"`
	UnidentifiedRecords  int64    `json:"unidentified_records"`
	Phantoms             []struct {
		EventID string `json:"event_id"`
		Topic   string `json:"topic"`
	} `json:"phantoms"`
}

// reconcile runs the command with --json and returns its exit code and
// report.
func (e *env) reconcile(args ...string) (int, report) {
	e.t.Helper()
	started := time.Now()
	code, out := harness.RunCommand(e.t, e.bin, e.command("reconcile", append([]string{"--json"}, args...)...), "OUTBOX_RELAY_LOG_LEVEL=warn")
	e.t.Logf("reconcile %v: exit %d in %s", args, code, time.Since(started))
	var rep report
	start := strings.Index(out, "{\n")
	if start < 0 {
		e.t.Fatalf("reconcile %v exited %d with no JSON report:\n%s", args, code, out)
	}
	if err := json.NewDecoder(strings.NewReader(out[start:])).Decode(&rep); err != nil {
		e.t.Fatalf("reconcile %v: decode report: %v\n%s", args, err, out)
	}
	return code, rep
}

func sameSet(got, want []string) bool {
	g := append([]string(nil), got...)
	w := append([]string(nil), want...)
	sort.Strings(g)
	sort.Strings(w)
	return strings.Join(g, ",") == strings.Join(w, ",")
}
