package ops

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// createRole creates a login role (cluster-wide, so named after the test's
// database) with the given attributes and password.
func createRole(t *testing.T, name, attrs, password string) {
	t.Helper()
	cluster.Exec(t, fmt.Sprintf("CREATE ROLE %s LOGIN %s PASSWORD '%s'", name, attrs, password))
}

// The relay's PostgreSQL password must never appear in anything it prints
// or serves: logs on success, logs and exit messages on every failure
// path, the admin endpoint. Both DSN forms (URL and key=value) are tried.
func TestPostgresPasswordIsNeverPrinted(t *testing.T) {
	t.Parallel()
	const secret = "Pg-Secret-9f3b71c2"
	const wrong = "Pg-Wrong-5e2c80d4"
	e := newEnv(t)
	e.Migrate()
	role := "pw_" + e.Slot
	createRole(t, role, "REPLICATION", secret)
	e.DB.Exec(t, "GRANT SELECT, INSERT, UPDATE ON outbox_quarantine TO "+role)

	// A port nobody listens on.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadPort := ln.Addr().(*net.TCPAddr).Port
	ln.Close()

	url := e.DB.DSNFor(role, secret)
	kv := func(port int, password string) string {
		return fmt.Sprintf("host=127.0.0.1 port=%d user=%s password=%s dbname=%s sslmode=disable", port, role, password, e.DB.Name())
	}
	leaks := func(what, text string) {
		t.Helper()
		for _, pw := range []string{secret, wrong} {
			if strings.Contains(text, pw) {
				t.Errorf("%s shows a password:\n%s", what, harness.LastLines(text, 20))
			}
		}
	}

	t.Run("streaming", func(t *testing.T) {
		p := e.start(e.argsAs(url, "run"))
		p.WaitForOutput(t, `"message":"streaming"`, time.Minute)
		harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, insert(t, e.DB.DSN(), "order", 3), time.Minute)
		base := p.AdminURL(t)
		for _, path := range []string{"/slot", "/readyz", "/metrics"} {
			_, body := harness.HTTPGet(t, base+path)
			leaks(path, body)
		}
		if p.Exited() {
			t.Fatalf("the relay exited before SIGTERM:\n%s", harness.LastLines(p.Output(), 10))
		}
		if code, err := p.Stop(time.Minute); err != nil || code != 0 {
			t.Errorf("SIGTERM: exit %d (%v)", code, err)
		}
		leaks("the relay's output", p.Output())
	})

	// A wrong password is a precondition the operator must fix: the relay
	// stops, saying what to check.
	for name, dsn := range map[string]string{"wrong password, URL": e.DB.DSNFor(role, wrong), "wrong password, key=value": kv(cluster.Port(), wrong)} {
		t.Run(name, func(t *testing.T) {
			p := e.start(e.argsAs(dsn, "run"))
			code, err := p.Wait(time.Minute)
			if err != nil || code == 0 {
				t.Fatalf("run with a wrong password: exit %d (%v), want a non-zero exit", code, err)
			}
			if !strings.Contains(p.Output(), "password authentication failed") || !strings.Contains(p.Output(), "check the user and password") {
				t.Errorf("run with a wrong password does not say so:\n%s", harness.LastLines(p.Output(), 10))
			}
			leaks("run's output", p.Output())
			for _, cmd := range []string{"status", "migrate"} {
				code, out := e.run(e.argsAs(dsn, cmd))
				if code == 0 || !strings.Contains(out, "password authentication failed") {
					t.Errorf("%s with a wrong password exited %d:\n%s", cmd, code, out)
				}
				leaks(cmd+"'s output", out)
			}
		})
	}

	// An unreachable server is transient: the relay retries, and its
	// errors and readiness name the server without the password.
	t.Run("unreachable server", func(t *testing.T) {
		for _, dsn := range []string{strings.Replace(url, fmt.Sprintf(":%d/", cluster.Port()), fmt.Sprintf(":%d/", deadPort), 1), kv(deadPort, secret)} {
			p := e.start(e.argsAs(dsn, "run"))
			base := p.AdminURL(t)
			harness.WaitFor(t, time.Minute, "two failed connection attempts", func() bool {
				return harness.Metric(t, base, "outbox_relay_stream_restarts_total") >= 2
			})
			code, body := harness.HTTPGet(t, base+"/readyz")
			if code != http.StatusServiceUnavailable || !strings.Contains(body, fmt.Sprint(deadPort)) {
				t.Errorf("/readyz with the server unreachable: %d %q, want 503 naming the server", code, body)
			}
			leaks("/readyz", body)
			_, slot := harness.HTTPGet(t, base+"/slot")
			leaks("/slot", slot)
			p.Kill()
			leaks("the relay's output", p.Output())
			code, out := e.run(e.argsAs(dsn, "status"))
			if code == 0 {
				t.Errorf("status against an unreachable server exited 0")
			}
			leaks("status's output", out)
		}
	})

	// A DSN that does not parse is quoted back only without its password.
	t.Run("malformed DSN", func(t *testing.T) {
		bad := fmt.Sprintf("postgres://%s:%s@127.0.0.1:notaport/%s", role, secret, e.DB.Name())
		for _, cmd := range []string{"run", "status", "migrate"} {
			code, out := e.run(e.argsAs(bad, cmd))
			if code == 0 || !strings.Contains(out, "--pg-dsn") {
				t.Errorf("%s with a malformed DSN exited %d without naming --pg-dsn:\n%s", cmd, code, out)
			}
			leaks(cmd+"'s output", out)
		}
	})
}

// The least a relay needs, proven end to end: the table, publication and
// quarantine table are created by their owner (no superuser, no
// REPLICATION), the slot by the relay's role, which is LOGIN REPLICATION
// with no superuser and no access to the outbox table itself. It streams
// every event; quarantining needs SELECT, INSERT, UPDATE on the quarantine
// table; retention needs SELECT, DELETE on the outbox table.
func TestMinimalRole(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	owner, relayRole := "own_"+e.Slot, "rel_"+e.Slot
	const ownerPass, relayPass = "owner-pw-41d7", "relay-pw-c03e"
	createRole(t, owner, "NOSUPERUSER NOREPLICATION", ownerPass)
	createRole(t, relayRole, "NOSUPERUSER REPLICATION", relayPass)
	// What a schema owner has: it may create tables and publications.
	e.DB.Exec(t, fmt.Sprintf("GRANT CREATE ON DATABASE %s TO %s; GRANT CREATE ON SCHEMA public TO %s", e.DB.Name(), owner, owner))
	ownerDSN, relayDSN := e.DB.DSNFor(owner, ownerPass), e.DB.DSNFor(relayRole, relayPass)

	// The owner cannot create the slot; it creates the rest.
	if code, out := e.run(e.argsAs(ownerDSN, "migrate")); code == 0 || !strings.Contains(out, "REPLICATION") {
		t.Errorf("migrate as a role without REPLICATION exited %d without naming the attribute:\n%s", code, out)
	}
	if code, out := e.run(e.argsAs(ownerDSN, "migrate", "--skip-slot")); code != 0 {
		t.Fatalf("migrate --skip-slot as the owner exited %d:\n%s", code, out)
	}
	if code, out := e.run(e.argsAs(relayDSN, "migrate", "--slot-only")); code != 0 {
		t.Fatalf("migrate --slot-only as the relay's role exited %d:\n%s", code, out)
	}
	// Grants come from the owner, as they would in production.
	ownerDB := func(sql string) {
		t.Helper()
		e.DB.Exec(t, "SET ROLE "+owner+"; "+sql+"; RESET ROLE")
	}
	ownerDB("GRANT SELECT, INSERT, UPDATE ON outbox_quarantine TO " + relayRole)

	for _, q := range []struct{ sql, want string }{
		{fmt.Sprintf("SELECT rolsuper::text FROM pg_roles WHERE rolname = '%s'", relayRole), "false"},
		{fmt.Sprintf("SELECT has_table_privilege('%s', 'outbox_events', 'SELECT')::text", relayRole), "false"},
		{fmt.Sprintf("SELECT has_table_privilege('%s', 'outbox_events', 'INSERT')::text", relayRole), "false"},
		{fmt.Sprintf("SELECT rolreplication::text FROM pg_roles WHERE rolname = '%s'", owner), "false"},
	} {
		if got := e.DB.QueryString(t, q.sql); got != q.want {
			t.Fatalf("%s = %s, want %s", q.sql, got, q.want)
		}
	}

	p := e.start(e.argsAs(relayDSN, "run"))
	p.WaitForOutput(t, `"message":"streaming"`, time.Minute)
	base := p.AdminURL(t)
	ids := insert(t, ownerDSN, "order", 20)
	// A topic name Kafka refuses: the event goes to the quarantine table.
	bad := harness.NewUUID()
	e.DB.Exec(t, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
		VALUES ($1, 'not a topic!', 'a', 'Happened', '{}')`, bad)
	ids = append(ids, insert(t, ownerDSN, "order", 5)...)
	end := e.DB.QueryString(t, "SELECT pg_current_wal_lsn()::text")
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, ids, time.Minute)
	harness.WaitFor(t, time.Minute, "the refused event in the quarantine table", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE event_id = $1", bad) == 1
	})
	harness.WaitFor(t, 30*time.Second, "outbox_relay_quarantined_events to count it", func() bool {
		v, _ := harness.MetricValue(harness.Scrape(t, base), "outbox_relay_quarantined_events")
		return v == 1
	})
	// The slot advanced past the quarantined event: nothing is stuck.
	harness.WaitFor(t, time.Minute, "the slot to confirm the last event", func() bool {
		return e.DB.QueryString(t, `SELECT (confirmed_flush_lsn >= $2::pg_lsn)::text
			FROM pg_replication_slots WHERE slot_name = $1`, e.Slot, end) == "true"
	})
	if p.Exited() {
		t.Fatalf("the relay exited before SIGTERM:\n%s", harness.LastLines(p.Output(), 10))
	}
	if code, err := p.Stop(time.Minute); err != nil || code != 0 {
		t.Fatalf("SIGTERM: exit %d (%v)", code, err)
	}

	// Retention deletes published rows: SELECT and DELETE on the outbox.
	ownerDB("GRANT SELECT, DELETE ON outbox_events TO " + relayRole)
	rows := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events")
	p = e.start(e.argsAs(relayDSN, "run", "--retention", "1s", "--retention-margin", "0s", "--retention-interval", "500ms"))
	p.WaitForOutput(t, `"message":"streaming"`, time.Minute)
	base = p.AdminURL(t)
	last := insert(t, ownerDSN, "order", 1)
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, last, time.Minute)
	harness.WaitFor(t, time.Minute, "retention to delete the published rows", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events") < rows
	})
	if v := harness.Metric(t, base, "outbox_relay_retention_rows_deleted_total"); v < 1 {
		t.Errorf("retention deleted rows but outbox_relay_retention_rows_deleted_total = %v", v)
	}
	if strings.Contains(p.Output(), "cleanup failed") {
		t.Errorf("retention failed with SELECT and DELETE granted:\n%s", harness.LastLines(p.Output(), 10))
	}
}

// A role without USAGE on the outbox's schema cannot see any table in it.
// run retried that for ever with the raw "permission denied for schema"
// (issue 30); like a missing table grant, it must stop at once (exit 1)
// with the GRANT to run, in WAL mode and in poll mode.
func TestMissingSchemaUsageStopsWithTheGrant(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	role := "nousage_" + e.Slot
	const pass = "nousage-pw-7a21"
	createRole(t, role, "NOSUPERUSER REPLICATION", pass)
	e.DB.Exec(t, "CREATE SCHEMA app")
	dsn := e.DB.DSNFor(role, pass)
	want := fmt.Sprintf(`GRANT USAGE ON SCHEMA "app" TO "%s"`, role)
	for _, mode := range []struct {
		name   string
		flags  []string
		grants string
	}{
		{"wal", []string{"--table", "app.outbox_events"},
			"GRANT SELECT, INSERT, UPDATE ON app.outbox_quarantine TO " + role},
		{"poll", []string{"--table", "app.poll_events", "--source", "poll"},
			fmt.Sprintf("GRANT SELECT, DELETE ON app.poll_events TO %[1]s; GRANT SELECT, UPDATE, DELETE ON app.poll_events_poll TO %[1]s; GRANT SELECT, INSERT, UPDATE ON app.outbox_quarantine TO %[1]s", role)},
	} {
		t.Run(mode.name, func(t *testing.T) {
			e.Migrate(mode.flags...)
			e.DB.Exec(t, mode.grants)
			p := e.start(e.argsAs(dsn, "run", mode.flags...))
			code, err := p.Wait(30 * time.Second)
			if err != nil {
				p.Kill()
				t.Fatalf("run without USAGE on the schema is still running after 30 s (%v):\n%s", err, harness.LastLines(p.Output(), 5))
			}
			// The log line is JSON: its quotes come escaped.
			if code != 1 || !strings.Contains(strings.ReplaceAll(p.Output(), `\"`, `"`), want) {
				t.Fatalf("run without USAGE on the schema: exit %d, want 1 naming %q:\n%s", code, want, harness.LastLines(p.Output(), 5))
			}
			// The GRANT it names is enough.
			e.DB.Exec(t, want)
			p = e.start(e.argsAs(dsn, "run", mode.flags...))
			waitFor := `"message":"streaming"`
			if mode.name == "poll" {
				waitFor = `"message":"polling"`
			}
			p.WaitForOutput(t, waitFor, time.Minute)
			p.Stop(time.Minute)
			e.DB.Exec(t, "REVOKE USAGE ON SCHEMA app FROM "+role)
		})
	}
}

// run created the replication slot before it checked its quarantine
// privileges, then stopped on them and left a slot nobody reads holding
// WAL (issue 30). Every check must come before the slot: the failed start
// leaves no slot behind.
func TestFailedStartLeavesNoSlot(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	role := "noquar_" + e.Slot
	const pass = "noquar-pw-19c4"
	createRole(t, role, "NOSUPERUSER REPLICATION", pass)
	e.Migrate("--skip-slot")
	code, out := e.run(e.argsAs(e.DB.DSNFor(role, pass), "run"))
	if code != 1 || !strings.Contains(out, "GRANT SELECT, INSERT, UPDATE ON") {
		t.Errorf("run without quarantine privileges: exit %d, want 1 naming the GRANT:\n%s", code, harness.LastLines(out, 5))
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", e.Slot); n != 0 {
		t.Errorf("the failed start left %d replication slot %s behind", n, e.Slot)
	}
}

// Issue 30: a retention that fails at every interval only logged a
// warning behind a ready relay. Each failed pass is now counted
// (outbox_relay_retention_failures_total, alerted on by
// OutboxRelayRetentionFailing) while streaming goes on.
func TestRetentionFailuresAreCounted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	role := "ret_" + e.Slot
	const pass = "ret-pw-8b2f"
	createRole(t, role, "NOSUPERUSER REPLICATION", pass)
	e.DB.Exec(t, "GRANT SELECT, INSERT, UPDATE ON outbox_quarantine TO "+role+"; GRANT SELECT, DELETE ON outbox_events TO "+role)
	p := e.start(e.argsAs(e.DB.DSNFor(role, pass), "run", "--retention", "1s", "--retention-margin", "0s", "--retention-interval", "300ms"))
	p.WaitForOutput(t, `"message":"streaming"`, time.Minute)
	base := p.AdminURL(t)
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, insert(t, e.DB.DSN(), "order", 1), time.Minute)
	e.DB.Exec(t, "REVOKE DELETE ON outbox_events FROM "+role)
	harness.WaitFor(t, 30*time.Second, "failed cleanup passes to be counted", func() bool {
		return harness.Metric(t, base, "outbox_relay_retention_failures_total") >= 2
	})
	if code, body := harness.HTTPGet(t, base+"/readyz"); code != http.StatusOK {
		t.Errorf("/readyz %d %q: a failing cleanup must not stop the stream", code, body)
	}
}

// A progress topic Kafka refuses to create stops run (exit 1), and, as
// every other start-up check, before the slot is made: the failed start
// leaves no slot holding WAL.
func TestRefusedProgressTopicLeavesNoSlot(t *testing.T) {
	t.Parallel()
	e := newEnvNoKafka(t)
	e.Kafka = harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: 3, DisableAutoCreate: true})
	e.Brokers = e.Kafka.Brokers()
	e.Migrate("--skip-slot")
	harness.RefuseCreateTopics(e.Kafka.Cluster())
	p := e.start(e.Args("run"))
	code, err := p.Wait(time.Minute)
	if err != nil {
		p.Kill()
		t.Fatalf("run with a progress topic Kafka refuses to create is still running after a minute")
	}
	if code != 1 || !strings.Contains(p.Output(), "--create --topic") {
		t.Errorf("run with a progress topic Kafka refuses to create: exit %d, want 1 with the command that creates it:\n%s", code, harness.LastLines(p.Output(), 5))
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", e.Slot); n != 0 {
		t.Errorf("the failed start left replication slot %s behind", e.Slot)
	}
}
