package e2e

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// debeziumTable is Debezium's documented outbox table, with the timestamp
// column the router's table.field.event.timestamp can name and one extra
// field, tenant, placed as a header.
const debeziumTable = `CREATE TABLE public.outbox_events (
	id            uuid         PRIMARY KEY DEFAULT gen_random_uuid(),
	aggregatetype varchar(255) NOT NULL,
	aggregateid   varchar(255) NOT NULL,
	type          varchar(255) NOT NULL,
	payload       jsonb,
	timestamp     timestamptz  NOT NULL DEFAULT now(),
	tenant        text
)`

// debeziumFlags are the flags of every command in these tests.
var debeziumFlags = []string{"--outbox-layout", "debezium", "--header-columns", "tenant"}

// debeziumRow is one outbox row as the router's documentation turns it
// into a record: topic outbox.event.<aggregatetype>, key aggregateid, value
// the payload's jsonb text (null for SQL NULL), one header id, and the
// header columns (null for SQL NULL).
type debeziumRow struct {
	id, aggregateType, aggregateID string
	payload, tenant                *string
}

func (e *env) debeziumRows(where string) map[string]debeziumRow {
	e.T.Helper()
	rows, err := e.DB.Connect(e.T).Query(context.Background(),
		"SELECT id::text, aggregatetype, aggregateid, payload::text, tenant FROM outbox_events "+where)
	if err != nil {
		e.T.Fatal(err)
	}
	defer rows.Close()
	out := map[string]debeziumRow{}
	for rows.Next() {
		var r debeziumRow
		if err := rows.Scan(&r.id, &r.aggregateType, &r.aggregateID, &r.payload, &r.tenant); err != nil {
			e.T.Fatal(err)
		}
		out[r.id] = r
	}
	if err := rows.Err(); err != nil {
		e.T.Fatal(err)
	}
	return out
}

// checkRouterRecord compares a record read back with the independent
// client to the router's record for the row, null values included.
func checkRouterRecord(t *testing.T, rec harness.Record, row debeziumRow) {
	t.Helper()
	nullable := func(b []byte) string {
		if b == nil {
			return "<null>"
		}
		return fmt.Sprintf("%q", b)
	}
	want := func(s *string) string {
		if s == nil {
			return "<null>"
		}
		return fmt.Sprintf("%q", *s)
	}
	var problems []string
	if rec.Topic != "outbox.event."+row.aggregateType {
		problems = append(problems, "topic "+rec.Topic)
	}
	if string(rec.Key) != row.aggregateID {
		problems = append(problems, "key "+nullable(rec.Key))
	}
	if got, w := nullable(rec.Value), want(row.payload); got != w {
		problems = append(problems, fmt.Sprintf("value %s, want %s", got, w))
	}
	if !slices.Equal(rec.HeaderKeys, []string{"id", "tenant"}) {
		problems = append(problems, fmt.Sprintf("header keys %q, want [id tenant]", rec.HeaderKeys))
	} else {
		if got := nullable(rec.HeaderValues[0]); got != fmt.Sprintf("%q", row.id) {
			problems = append(problems, "header id "+got)
		}
		if got, w := nullable(rec.HeaderValues[1]), want(row.tenant); got != w {
			problems = append(problems, fmt.Sprintf("header tenant %s, want %s", got, w))
		}
	}
	if p := harness.JavaPartition(rec.Key, partitions); rec.Partition != p {
		problems = append(problems, fmt.Sprintf("partition %d, want murmur2 %d", rec.Partition, p))
	}
	if len(problems) > 0 {
		t.Errorf("record of row %s: %s", row.id, strings.Join(problems, "; "))
	}
}

// checkRouterRecords reads a record for every row of the table, once each,
// and checks each against the router's record for its row.
func (e *env) checkRouterRecords() (map[string]debeziumRow, map[string]harness.Record) {
	e.T.Helper()
	rows := e.debeziumRows("")
	ids := make([]string, 0, len(rows))
	for id := range rows {
		ids = append(ids, id)
	}
	byID, all := consumeIDs(e.T, e.Kafka.Brokers(), ids, time.Minute)
	if len(all) != len(rows) {
		e.T.Errorf("%d records for %d rows", len(all), len(rows))
	}
	for id, row := range rows {
		checkRouterRecord(e.T, byID[id], row)
	}
	return rows, byID
}

// consumeIDs reads until every id has a record and returns the records by id
// (the last of each).
func consumeIDs(t *testing.T, brokers []string, ids []string, timeout time.Duration) (map[string]harness.Record, []harness.Record) {
	t.Helper()
	all := harness.ConsumeUntil(t, brokers, `^outbox\.event\.`, timeout, func(all []harness.Record) bool {
		seen := map[string]bool{}
		for _, r := range all {
			seen[r.Headers["id"]] = true
		}
		for _, id := range ids {
			if !seen[id] {
				return false
			}
		}
		return true
	})
	byID := map[string]harness.Record{}
	for _, r := range all {
		byID[r.Headers["id"]] = r
	}
	return byID, all
}

// With --outbox-layout debezium the relay takes over a Debezium outbox
// table as it stands and publishes the router's records: topic, key,
// value (a SQL NULL payload as a null value, a JSON null as the four bytes
// null), headers exactly id and tenant (null where tenant is NULL), and the
// Java client's murmur2 partition.
func TestDebeziumLayoutPublishesRouterRecords(t *testing.T) {
	e := newEnv(t)
	e.DB.Exec(t, debeziumTable)
	e.Migrate(debeziumFlags...)
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_attribute WHERE attrelid = 'public.outbox_events'::regclass AND attnum > 0 AND NOT attisdropped"); n != 7 {
		t.Fatalf("migrate changed the Debezium table: %d columns, want its 7", n)
	}
	e.StartRelay(debeziumFlags...)
	e.DB.Exec(t, `INSERT INTO outbox_events (aggregatetype, aggregateid, type, payload, tenant) VALUES
		('order', 'o-1', 'OrderPlaced', '{"total": 12.5, "items": [1, 2], "note": "caf\u00e9"}', 'acme'),
		('order', 'o-2', 'OrderDeleted', NULL, 'acme'),
		('customer', 'c-1', 'Nothing', 'null', NULL),
		('customer', 'c-2', 'Placed', '{"b":1,   "a":"x"}', 'globex')`)
	rows, byID := e.checkRouterRecords()
	// The cases the record shape turns on, said outright.
	for id, row := range rows {
		r := byID[id]
		switch row.aggregateID {
		case "o-2":
			if r.Value != nil {
				t.Errorf("SQL NULL payload gave value %q, want null", r.Value)
			}
		case "c-1":
			if string(r.Value) != "null" || r.HeaderValues[1] != nil {
				t.Errorf("JSON null payload gave value %q, tenant %q; want the bytes null and a null tenant", r.Value, r.HeaderValues[1])
			}
		case "c-2":
			if string(r.Value) != `{"a": "x", "b": 1}` {
				t.Errorf("value %q, want PostgreSQL's jsonb text", r.Value)
			}
		}
	}
}

// Poll mode reads a Debezium table through the same mapping, with either
// strategy: the lease strategy's trigger and claim, or the snapshot
// strategy's columns added to that table, use its columns (id,
// aggregatetype, aggregateid), and the records are the router's, byte for
// byte as the WAL path sends them. A row written before migrate is
// published too.
func TestDebeziumLayoutPollMode(t *testing.T) {
	for _, strategy := range []string{"lease", "snapshot"} {
		t.Run(strategy, func(t *testing.T) {
			e := newEnv(t)
			e.DB.Exec(t, debeziumTable)
			e.DB.Exec(t, `INSERT INTO outbox_events (aggregatetype, aggregateid, type, payload, tenant) VALUES
				('order', 'o-1', 'OrderPlaced', '{"total": 12.5}', 'acme')`) // before migrate: tracked by it
			flags := []string{"--pg-dsn", e.DB.DSN(), "--source", "poll", "--poll-strategy", strategy, "--outbox-layout", "debezium", "--header-columns", "tenant"}
			harness.Migrate(t, e.Bin, append([]string{"migrate"}, flags...))
			p := harness.StartProcess(t, e.Bin, append([]string{"run", "--kafka-brokers", e.Kafka.BrokerList(), "--admin-addr", ""}, flags...),
				[]string{harness.LogLevelInfo})
			p.WaitForOutput(t, `"message":"polling"`, time.Minute)
			e.DB.Exec(t, `INSERT INTO outbox_events (aggregatetype, aggregateid, type, payload, tenant) VALUES
				('order', 'o-1', 'OrderPaid', NULL, 'acme'),
				('customer', 'c-1', 'Nothing', 'null', NULL)`)
			e.checkRouterRecords()
			if strategy == "lease" {
				harness.WaitFor(t, 30*time.Second, "every row marked published", func() bool {
					return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll WHERE published_at IS NULL") == 0
				})
			}
		})
	}
}

// Poll-mode retention on a Debezium table deletes published rows by the
// layout's event id column (id, not event_id), outbox row and state row
// together, and the poller stays ready throughout.
func TestDebeziumLayoutPollRetention(t *testing.T) {
	e := newEnv(t)
	e.DB.Exec(t, debeziumTable)
	harness.Migrate(t, e.Bin, []string{"migrate", "--source", "poll", "--pg-dsn", e.DB.DSN(), "--outbox-layout", "debezium", "--header-columns", "tenant"})
	p := harness.StartProcess(t, e.Bin, []string{"run", "--source", "poll", "--pg-dsn", e.DB.DSN(), "--kafka-brokers", e.Kafka.BrokerList(),
		"--admin-addr", "127.0.0.1:0", "--outbox-layout", "debezium", "--header-columns", "tenant",
		"--retention", "1s", "--retention-interval", "1s"}, []string{harness.LogLevelInfo})
	p.WaitForOutput(t, `"message":"polling"`, time.Minute)
	admin := p.AdminURL(t)
	e.DB.Exec(t, `INSERT INTO outbox_events (aggregatetype, aggregateid, type, payload, tenant)
		SELECT 'order', 'o-' || (i % 3), 'OrderPlaced', jsonb_build_object('n', i), NULL FROM generate_series(1, 20) i`)
	e.checkRouterRecords()
	harness.WaitFor(t, time.Minute, "retention deletes every published row", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events") == 0 &&
			e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events_poll") == 0
	})
	if n := harness.Metric(t, admin, "outbox_relay_retention_rows_deleted_total"); n != 20 {
		t.Errorf("outbox_relay_retention_rows_deleted_total = %v, want 20", n)
	}
	resp, err := http.Get(admin + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/readyz is %d after retention ran, want 200:\n%s", resp.StatusCode, harness.LastLines(p.Output(), 20))
	}
	if strings.Contains(p.Output(), "poll session failed") {
		t.Errorf("a poll session failed:\n%s", harness.LastLines(p.Output(), 20))
	}
}

// migrate checks a Debezium table before it makes anything: a mapped column
// of the wrong type is exit 2 naming the column and its flag, a missing
// table is exit 1 saying migrate does not create it, an unknown layout is
// exit 2 naming the flag.
func TestDebeziumMigrateChecksTheTable(t *testing.T) {
	e := newEnv(t)
	code, out := harness.RunCommand(t, e.Bin, e.Args("migrate", append(debeziumFlags, "--outbox-layout", "debezum")...))
	if code != 2 || !strings.Contains(out, `--outbox-layout "debezum"`) {
		t.Fatalf("unknown layout: exit %d, want 2 naming the flag: %s", code, out)
	}
	code, out = harness.RunCommand(t, e.Bin, e.Args("migrate", debeziumFlags...))
	if code != 1 || !strings.Contains(out, "does not exist") || !strings.Contains(out, "never creates it") {
		t.Fatalf("missing table: exit %d, want 1 saying what to do: %s", code, out)
	}
	e.DB.Exec(t, strings.Replace(debeziumTable, "aggregateid   varchar(255)", "aggregateid   bigint", 1))
	code, out = harness.RunCommand(t, e.Bin, e.Args("migrate", debeziumFlags...))
	if code != 2 || !strings.Contains(out, "column aggregateid (--column-aggregate-id) is bigint") {
		t.Fatalf("wrongly typed column: exit %d, want 2 naming the column: %s", code, out)
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_publication"); n != 0 {
		t.Fatalf("a failed check still made %d publications", n)
	}
	// Mapped to a column of the right type, the same table passes.
	e.DB.Exec(t, "ALTER TABLE outbox_events ADD COLUMN aggregate_key text")
	e.DB.Exec(t, "UPDATE outbox_events SET aggregate_key = aggregateid::text")
	e.Migrate(append(debeziumFlags, "--column-aggregate-id", "aggregate_key")...)
}

// A Debezium-layout event Kafka refuses is quarantined with its header
// columns and NULL payload kept, and replay publishes the router's record
// for it, null value and null header included.
func TestDebeziumQuarantineReplayKeepsRouterShape(t *testing.T) {
	e := newEnv(t)
	e.DB.Exec(t, debeziumTable)
	e.Kafka.CreateTopic(t, "outbox.event.order", partitions, map[string]string{"max.message.bytes": "4000"})
	e.Migrate(debeziumFlags...)
	e.StartRelay(debeziumFlags...)
	big := randomText(10000)
	e.DB.Exec(t, `INSERT INTO outbox_events (aggregatetype, aggregateid, type, payload, tenant) VALUES
		('order', 'o-1', 'Small', '{"n": 1}', NULL),
		('order', 'o-1', 'BigTenant', NULL, $1),
		('order', 'o-2', 'BigPayload', jsonb_build_object('blob', $1::text), NULL)`, big)
	rows := e.debeziumRows("")
	small := e.debeziumRows("WHERE type = 'Small'")
	var smallID string
	for id := range small {
		smallID = id
	}
	consumeIDs(t, e.Kafka.Brokers(), []string{smallID}, time.Minute)
	harness.WaitFor(t, 30*time.Second, "both big events quarantined", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine") == 2
	})
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE payload IS NULL AND headers->>'tenant' = $1", big); n != 1 {
		t.Fatalf("the NULL-payload event is not kept with a NULL payload and its tenant (%d rows)", n)
	}

	adm := kadm.NewClient(e.Kafka.Client(t))
	limit := "1048588"
	resp, err := adm.AlterTopicConfigs(context.Background(), []kadm.AlterConfig{{Name: "max.message.bytes", Value: &limit}}, "outbox.event.order")
	if err == nil {
		_, err = resp.On("outbox.event.order", nil)
	}
	if err != nil {
		t.Fatalf("raise max.message.bytes: %v", err)
	}
	replay := append([]string{"quarantine", "replay", "--all", "--kafka-brokers", e.Kafka.BrokerList()}, e.Args("", debeziumFlags...)[1:]...)
	if code, out := harness.RunCommand(t, e.Bin, replay); code != 0 {
		t.Fatalf("quarantine replay exited %d: %s", code, out)
	}
	ids := make([]string, 0, len(rows))
	for id := range rows {
		ids = append(ids, id)
	}
	byID, _ := consumeIDs(t, e.Kafka.Brokers(), ids, time.Minute)
	for id, row := range rows {
		checkRouterRecord(t, byID[id], row)
	}
}

// The hand-over of docs/debezium-migration.md, with a stand-in for the
// connector: a relay in the debezium layout on a slot of its own publishes
// what Debezium would. The relay's slot is made while the connector still
// runs, the connector is stopped once its slot passed that point, then the
// relay starts. Every event arrives, those between the two points twice
// with the same id, and reconcile in the debezium layout finds no gap.
func TestDebeziumHandOver(t *testing.T) {
	e := newEnv(t)
	e.DB.Exec(t, debeziumTable)
	ctx := context.Background()
	const connectorSlot = "connector_standin"
	e.DB.DropSlotAtEnd(t, connectorSlot)
	connectorArgs := harness.RelayFlags{DSN: e.DB.DSN(), Slot: connectorSlot, Brokers: e.Kafka.Brokers()}
	harness.Migrate(t, e.Bin, connectorArgs.Args("migrate", append(debeziumFlags, "--publication", "connector_pub", "--quarantine-table", "public.connector_quarantine")...))
	connector := harness.StartStreaming(t, e.Bin, connectorArgs.Args("run", append(debeziumFlags, "--publication", "connector_pub", "--quarantine-table", "public.connector_quarantine", "--status-interval", "100ms")...), harness.LogLevelInfo)

	write := func(batch string, n int) []string {
		t.Helper()
		ids := make([]string, n)
		conn := e.DB.Connect(t)
		for i := range ids {
			if err := conn.QueryRow(ctx, "INSERT INTO outbox_events (aggregatetype, aggregateid, type, payload, tenant) VALUES ('order', $1, 'Placed', jsonb_build_object('batch', $2::text, 'i', $3::int), 'acme') RETURNING id::text",
				fmt.Sprintf("o-%d", i%5), batch, i).Scan(&ids[i]); err != nil {
				t.Fatal(err)
			}
		}
		return ids
	}
	before := write("before", 20)
	consumeIDs(t, e.Kafka.Brokers(), before, time.Minute)

	// 1. The relay's slot, made while the connector runs: the table's rows
	// are the connector's to publish, and it goes on past the slot.
	e.Migrate(append(debeziumFlags, "--existing-rows", "published")...)
	relayStart := e.ConfirmedFlush()
	overlap := write("overlap", 20)
	consumeIDs(t, e.Kafka.Brokers(), overlap, time.Minute)
	// 2. Stop the connector once its slot passed the relay's start.
	harness.WaitFor(t, 30*time.Second, "connector slot passes the relay slot's start", func() bool {
		return harness.LSNAtMost(relayStart, e.DB.ConfirmedFlushLSN(t, connectorSlot))
	})
	if code, err := connector.Stop(30 * time.Second); err != nil || code != 0 {
		t.Fatalf("connector stand-in stopped with %d (%v)", code, err)
	}
	stoppedAt := e.DB.ConfirmedFlushLSN(t, connectorSlot)
	after := write("after", 20)
	// 3. The relay starts from its slot: at or before the connector's stop.
	if !harness.LSNAtMost(relayStart, stoppedAt) {
		t.Fatalf("relay slot starts at %s, after the connector stopped at %s", relayStart, stoppedAt)
	}
	e.StartRelay(debeziumFlags...)

	want := append(append(append([]string{}, before...), overlap...), after...)
	_, all := consumeIDs(t, e.Kafka.Brokers(), want, time.Minute)
	count := map[string]int{}
	for _, r := range all {
		count[r.Headers["id"]]++
	}
	for _, id := range before {
		if count[id] != 1 {
			t.Errorf("event %s from before the hand-over arrived %d times, want once", id, count[id])
		}
	}
	for _, id := range overlap {
		if count[id] != 2 {
			t.Errorf("event %s of the overlap arrived %d times, want twice (connector and relay)", id, count[id])
		}
	}
	for _, id := range after {
		if count[id] != 1 {
			t.Errorf("event %s from after the hand-over arrived %d times, want once", id, count[id])
		}
	}
	rows := e.debeziumRows("")
	for _, r := range all {
		checkRouterRecord(t, r, rows[r.Headers["id"]])
	}

	// Every row is acknowledged: the window may end now.
	reconcile := append([]string{"reconcile", "--since", "10m", "--until", "0s", "--kafka-brokers", e.Kafka.BrokerList()}, e.Args("", debeziumFlags...)[1:]...)
	code, out := harness.RunCommand(t, e.Bin, reconcile)
	if code != 0 || !strings.Contains(out, fmt.Sprintf("rows checked      %d", len(want))) || !strings.Contains(out, "missing           0") {
		t.Fatalf("reconcile exited %d, want 0 with %d rows and no gap: %s", code, len(want), out)
	}
}

// Debezium's stock table has no "timestamp" column. --retention on it was
// accepted, the relay reported ready, and every interval failed with
// `column "timestamp" does not exist` (issue 30). It is a flag problem:
// exit 2 at start naming --column-created-at, before any slot is made.
func TestDebeziumRetentionWithoutCreatedAtColumn(t *testing.T) {
	e := newEnv(t)
	e.DB.Exec(t, strings.Replace(debeziumTable, "timestamp     timestamptz  NOT NULL DEFAULT now(),", "", 1))
	e.Migrate(append(debeziumFlags, "--skip-slot")...)
	p := e.StartRelayNoWait(append(debeziumFlags, "--retention", "168h")...)
	code, err := p.Wait(30 * time.Second)
	if err != nil {
		p.Kill()
		t.Fatalf("run --retention without the column is still running after 30 s (%v):\n%s", err, harness.LastLines(p.Output(), 5))
	}
	if code != 2 || !strings.Contains(p.Output(), "--column-created-at") {
		t.Fatalf("run --retention without the column: exit %d, want 2 naming --column-created-at:\n%s", code, harness.LastLines(p.Output(), 5))
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", e.Slot); n != 0 {
		t.Errorf("the refused start left a replication slot")
	}
}

// Issue 51.8: the same table with --on-slot-lost recover was accepted at
// start, failed only once the slot was lost, and the command it then
// advised failed the same way. Republishing selects rows by their insert
// time, so both recover and --existing-rows pending are a flag problem on
// a table without that column: exit 2 at start, before any slot is made.
func TestDebeziumRecoverWithoutCreatedAtColumn(t *testing.T) {
	e := newEnv(t)
	e.DB.Exec(t, strings.Replace(debeziumTable, "timestamp     timestamptz  NOT NULL DEFAULT now(),", "", 1))
	e.Migrate(append(debeziumFlags, "--skip-slot")...)
	for _, flags := range [][]string{{"--on-slot-lost", "recover"}, {"--existing-rows", "pending"}} {
		p := e.StartRelayNoWait(append(append([]string(nil), debeziumFlags...), flags...)...)
		code, err := p.Wait(30 * time.Second)
		if err != nil {
			p.Kill()
			t.Fatalf("run %v without the insert-time column is still running after 30 s (%v):\n%s", flags, err, harness.LastLines(p.Output(), 5))
		}
		if code != 2 || !strings.Contains(p.Output(), "--column-created-at") {
			t.Errorf("run %v without the insert-time column: exit %d, want 2 naming --column-created-at:\n%s", flags, code, harness.LastLines(p.Output(), 5))
		}
		if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", e.Slot); n != 0 {
			t.Errorf("the refused start %v left a replication slot", flags)
		}
	}
}
