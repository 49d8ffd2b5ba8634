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
	*harness.Env
	conn *pgx.Conn
}

func newEnv(t *testing.T) *env {
	t.Helper()
	return &env{Env: harness.NewRelayEnv(t, cluster, partitions)}
}

// command is a command line: the command, the database, slot and (but
// for migrate) Kafka, then extra.
func (e *env) command(name string, extra ...string) []string {
	flags := harness.RelayFlags{DSN: e.DB.DSN(), Slot: e.Slot, Brokers: e.Brokers}
	if name != "migrate" && name != "run" {
		extra = append([]string{"--kafka-brokers", e.Kafka.BrokerList()}, extra...)
	}
	return flags.Args(name, extra...)
}

func (e *env) stopRelay(p *harness.Process) {
	e.T.Helper()
	if code, err := p.Stop(time.Minute); err != nil || code != 0 {
		e.T.Fatalf("relay exited %d (%v) on SIGTERM", code, err)
	}
}

// commit writes n single-event transactions for aggregateType and returns
// their ids.
func (e *env) commit(n int, aggregateType string) []string {
	e.T.Helper()
	e.connect()
	before := e.CommittedCount()
	for i := 0; i < n; i++ {
		ev := harness.OutboxEvent{AggregateType: aggregateType, AggregateID: fmt.Sprintf("%s-%d", aggregateType, i%3),
			EventType: "Happened", Payload: fmt.Sprintf(`{"n": %d}`, before+i)}
		if i%2 == 0 {
			ev.Headers = `{"tenant": "acme"}`
		}
		if err := e.Commit(context.Background(), e.conn, []harness.OutboxEvent{ev}); err != nil {
			e.T.Fatalf("commit: %v", err)
		}
	}
	ids, _ := e.Committed()
	return ids[before:]
}

// connect opens the test's own connection once.
func (e *env) connect() {
	e.T.Helper()
	if e.conn != nil {
		return
	}
	conn, err := pgx.Connect(context.Background(), e.DB.DSN())
	if err != nil {
		e.T.Fatalf("connect: %v", err)
	}
	e.T.Cleanup(func() { conn.Close(context.Background()) })
	e.conn = conn
}

// consumeAll waits until the independent consumer has every id.
func (e *env) consumeAll(ids []string) []harness.Record {
	e.T.Helper()
	records := harness.ConsumeEventIDs(e.T, e.Kafka.Brokers(), `^outbox\.event\.`, ids, time.Minute)
	harness.CheckNoLoss(e.T, records, ids)
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
	e.T.Helper()
	started := time.Now()
	code, out := harness.RunCommand(e.T, e.Bin, e.command("reconcile", append([]string{"--json"}, args...)...), "OUTBOX_RELAY_LOG_LEVEL=warn")
	e.T.Logf("reconcile %v: exit %d in %s", args, code, time.Since(started))
	var rep report
	start := strings.Index(out, "{\n")
	if start < 0 {
		e.T.Fatalf("reconcile %v exited %d with no JSON report:\n%s", args, code, out)
	}
	if err := json.NewDecoder(strings.NewReader(out[start:])).Decode(&rep); err != nil {
		e.T.Fatalf("reconcile %v: decode report: %v\n%s", args, err, out)
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
