package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Issue 11.8: a table with event_id bigint and aggregate_id int got
// "schema is up to date" from migrate. Both refuse it, naming the columns.
// A bytea payload, which run then published as the text \x00ff7b7d, is
// now a binary payload that goes out as its bytes (test/binary), so it is
// not named.
func TestWrongColumnTypesAreRefused(t *testing.T) {
	e := newEnv(t)
	e.DB.Exec(t, `CREATE TABLE outbox_events (event_id bigint PRIMARY KEY, aggregate_type text NOT NULL,
		aggregate_id int NOT NULL, event_type text NOT NULL, payload bytea NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`)
	for _, cmd := range [][]string{e.Args("migrate"), e.Args("run")} {
		p := harness.StartProcess(t, e.Bin, cmd, nil)
		code, err := p.Wait(time.Minute)
		if err != nil || code == 0 {
			t.Fatalf("%s exited %d (%v), want a failure:\n%s", cmd[0], code, err, p.Output())
		}
		out := p.Output()
		if strings.Contains(out, "schema is up to date") || strings.Contains(out, "column payload") ||
			!outputHas(out, "column event_id is bigint", "column aggregate_id is integer") {
			t.Errorf("%s does not name the wrong columns:\n%s", cmd[0], out)
		}
	}
}

// Issue 11.13: `migrate --print-sql` skipped validation and printed a slot
// name carrying SQL into the script.
func TestPrintSQLRefusesABadSlotName(t *testing.T) {
	e := newEnv(t)
	bad := "x'); select pg_drop_replication_slot('other'); --"
	p := harness.StartProcess(t, e.Bin, []string{"migrate", "--print-sql", "--slot", bad}, nil)
	code, err := p.Wait(time.Minute)
	if err != nil || code == 0 {
		t.Fatalf("exited %d (%v), want a failure:\n%s", code, err, p.Output())
	}
	if out := p.Output(); strings.Contains(out, "pg_drop_replication_slot('other')") && strings.Contains(out, "SELECT pg_create_logical_replication_slot") {
		t.Errorf("the bad name went into the SQL:\n%s", out)
	}
}

// Issue 40.7: `run --column-headers hdrs_typo` streamed, and every record
// lost the row's headers (traceparent, aggregate_version) without a word;
// the same for the other optional columns. A flag that names a column the
// table lacks is bad configuration: exit 2 naming the flag and the column,
// for the WAL source, the poll source and migrate, before anything streams.
func TestColumnFlagThatNamesNoColumnIsRefused(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	harness.Migrate(t, e.Bin, []string{"migrate", "--source", "poll", "--pg-dsn", e.DB.DSN()})
	for _, flag := range []string{"--column-headers", "--column-content-type", "--column-occurred-at", "--column-schema-version", "--column-created-at"} {
		typo := "typo_" + strings.ReplaceAll(strings.TrimPrefix(flag, "--column-"), "-", "_")
		for _, cmd := range [][]string{
			e.Args("run", flag, typo),
			{"run", "--source", "poll", "--pg-dsn", e.DB.DSN(), "--kafka-brokers", e.Kafka.BrokerList(), "--admin-addr", "", flag, typo},
		} {
			p := harness.StartProcess(t, e.Bin, cmd, nil)
			code, err := p.Wait(time.Minute)
			if err != nil || code != 2 || !outputHas(p.Output(), flag, typo, "does not have") {
				t.Errorf("%v: exit %d (%v), want 2 naming %s and %s:\n%s", cmd[:3], code, err, flag, typo, harness.LastLines(p.Output(), 5))
			}
		}
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE active"); n != 0 {
		t.Errorf("%d slots are active after every start was refused", n)
	}
}
