package harness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/throwaway"
	"github.com/outbox-relay/outbox-relay/lsn"
)

// PGBinEnv names the environment variable that, when set, points at the
// directory holding initdb, pg_ctl and postgres. Without it the newest
// /usr/lib/postgresql/<version>/bin is used, then whatever pg_ctl is on PATH.
const PGBinEnv = throwaway.PGBinEnv

// PGVersionEnv selects the PostgreSQL major version every cluster of the
// test binary runs, e.g. OUTBOX_RELAY_PG_VERSION=17. Debian's server is
// used where /usr/lib/postgresql/<major>/bin has one (15 here); 16, 17 and
// 18 come from test/postgres/fetch.sh's cache. Unset, the harness takes
// OUTBOX_RELAY_PG_BIN, else the newest Debian server.
const PGVersionEnv = throwaway.PGVersionEnv

// PGOptions configures a cluster started by StartPostgres: server
// settings, password authentication, synchronous_commit.
type PGOptions = throwaway.PGOptions

// Postgres is a throwaway PostgreSQL cluster listening on 127.0.0.1, with
// helpers that fail the test. All methods are safe for concurrent use, so
// parallel tests can share one cluster and each use its own database.
type Postgres struct {
	local *throwaway.Postgres
	dbSeq atomic.Int64
}

// SlotInfo is a replication slot's row in pg_replication_slots. LSNs are in
// PostgreSQL's text form (e.g. "0/16B3748"), empty when NULL.
type SlotInfo struct {
	Exists         bool
	Active         bool
	ActivePID      int
	ConfirmedFlush string
	RestartLSN     string
	WALStatus      string
}

// StartPostgres initialises and starts a new cluster for one test and stops
// it (immediate mode) and deletes its files when the test ends. If the test
// failed, the tail of the server log is logged.
//
// To share one cluster across a package's tests, start it in TestMain with
// StartPostgresMain instead, and give each test its own database with
// CreateDatabase or CreateTestDatabase.
func StartPostgres(t testing.TB, opts PGOptions) *Postgres {
	t.Helper()
	p, err := local.StartPostgres(opts)
	if err != nil {
		t.Fatalf("start postgres: %v", err)
	}
	return closeWithTest(t, p, "postgres")
}

// StartPostgresMain is StartPostgres for TestMain, where there is no
// testing.TB: it returns the cluster and a function that stops it and
// deletes its files. Main also calls that function after the tests run, so
// a TestMain that uses Main may ignore it.
func StartPostgresMain(opts PGOptions) (*Postgres, func(), error) {
	p, err := local.StartPostgres(opts)
	if err != nil {
		return nil, nil, err
	}
	return &Postgres{local: p}, p.Close, nil
}

// closeWithTest stops and deletes the cluster when the test ends, logging
// the tail of its server log if the test failed.
func closeWithTest(t testing.TB, p *throwaway.Postgres, what string) *Postgres {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s log tail (%s):\n%s", what, p.LogFile(), p.LogTail(50))
		}
		p.Close()
	})
	return &Postgres{local: p}
}

// Major is the server's major version (15, 16, ...).
func (p *Postgres) Major(t testing.TB) int {
	t.Helper()
	v, err := p.local.Major()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// Start starts a stopped cluster on the same port, with the same settings;
// it does nothing if the server is running. After StopImmediate or
// KillPostmaster this runs crash recovery.
func (p *Postgres) Start(t testing.TB) {
	t.Helper()
	if err := p.local.Start(); err != nil {
		t.Fatalf("start postgres: %v", err)
	}
}

// Stop shuts the cluster down in fast mode: sessions, walsenders included,
// are terminated and a shutdown checkpoint is written.
func (p *Postgres) Stop(t testing.TB) {
	t.Helper()
	if err := p.local.Stop(); err != nil {
		t.Fatalf("stop postgres: %v", err)
	}
}

// StopImmediate stops the cluster the way a crash would: no checkpoint, so
// the next Start replays WAL.
func (p *Postgres) StopImmediate(t testing.TB) {
	t.Helper()
	if err := p.local.StopImmediate(); err != nil {
		t.Fatalf("stop postgres immediately: %v", err)
	}
}

// ResetWAL runs pg_resetwal with args on the stopped cluster, e.g. "-e",
// "1" to move the transaction id epoch on.
func (p *Postgres) ResetWAL(t testing.TB, args ...string) {
	t.Helper()
	if err := p.local.ResetWAL(args...); err != nil {
		t.Fatal(err)
	}
}

// Restart is Stop followed by Start.
func (p *Postgres) Restart(t testing.TB) {
	t.Helper()
	if err := p.local.Restart(); err != nil {
		t.Fatalf("restart postgres: %v", err)
	}
}

// Port is the TCP port the cluster listens on; it stays the same across
// Stop/Start/Restart.
func (p *Postgres) Port() int { return p.local.Port() }

// DSN is a postgres:// URL for the superuser postgres and database db.
func (p *Postgres) DSN(db string) string { return p.local.DSN(db) }

// DSNFor is a postgres:// URL for user with password on database db.
func (p *Postgres) DSNFor(user, password, db string) string {
	return p.local.DSNFor(user, password, db)
}

// DataDir is the cluster's data directory.
func (p *Postgres) DataDir() string { return p.local.DataDir() }

// PostmasterPID is the running postmaster's pid, from postmaster.pid; it
// fails the test when the server is not running.
func (p *Postgres) PostmasterPID(t testing.TB) int {
	t.Helper()
	pid, err := p.local.PostmasterPID()
	if err != nil {
		t.Fatalf("postmaster pid: %v", err)
	}
	return pid
}

// KillPostmaster SIGKILLs the postmaster and returns once it is dead: a
// harsher crash than StopImmediate, as nobody tells the backends. Start
// afterwards waits for the orphaned backends to go and runs crash
// recovery.
func (p *Postgres) KillPostmaster(t testing.TB) {
	t.Helper()
	if err := p.local.KillPostmaster(); err != nil {
		t.Fatalf("kill postmaster: %v", err)
	}
}

// LogTail returns the last n lines of the server log.
func (p *Postgres) LogTail(n int) string { return p.local.LogTail(n) }

// Exec runs sql on the postgres database as the superuser. Without args,
// sql may hold several statements.
func (p *Postgres) Exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	p.DB("postgres").Exec(t, sql, args...)
}

// QueryInt64 is PGDatabase.QueryInt64 on the postgres database.
func (p *Postgres) QueryInt64(t testing.TB, sql string, args ...any) int64 {
	t.Helper()
	return p.DB("postgres").QueryInt64(t, sql, args...)
}

// QueryString is PGDatabase.QueryString on the postgres database.
func (p *Postgres) QueryString(t testing.TB, sql string, args ...any) string {
	t.Helper()
	return p.DB("postgres").QueryString(t, sql, args...)
}

// PGDatabase is one database of a Postgres cluster; its helpers connect as
// the superuser.
type PGDatabase struct {
	pg   *Postgres
	name string
}

// DB returns a handle on the existing database name.
func (p *Postgres) DB(name string) *PGDatabase {
	return &PGDatabase{pg: p, name: name}
}

// Name is the database name.
func (d *PGDatabase) Name() string { return d.name }

// DSN is the superuser DSN for this database.
func (d *PGDatabase) DSN() string { return d.pg.DSN(d.name) }

// DSNFor is the DSN for user with password on this database.
func (d *PGDatabase) DSNFor(user, password string) string {
	return d.pg.DSNFor(user, password, d.name)
}

// Exec runs sql. Without args, sql may hold several statements.
func (d *PGDatabase) Exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	err := d.pg.local.WithConn(d.name, func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, sql, args...)
		return err
	})
	if err != nil {
		t.Fatalf("exec %q on %s: %v", sql, d.name, err)
	}
}

// QueryInt64 returns the first column of the first row sql returns; no row
// or NULL fails the test.
func (d *PGDatabase) QueryInt64(t testing.TB, sql string, args ...any) int64 {
	t.Helper()
	var v *int64
	err := d.pg.local.WithConn(d.name, func(ctx context.Context, c *pgx.Conn) error {
		return c.QueryRow(ctx, sql, args...).Scan(&v)
	})
	if err != nil {
		t.Fatalf("query %q on %s: %v", sql, d.name, err)
	}
	if v == nil {
		t.Fatalf("query %q on %s: got NULL, want an integer", sql, d.name)
	}
	return *v
}

// QueryString returns the first column of the first row sql returns; NULL
// is returned as "", no row fails the test. Cast non-text columns in SQL
// (::text).
func (d *PGDatabase) QueryString(t testing.TB, sql string, args ...any) string {
	t.Helper()
	var v *string
	err := d.pg.local.WithConn(d.name, func(ctx context.Context, c *pgx.Conn) error {
		return c.QueryRow(ctx, sql, args...).Scan(&v)
	})
	if err != nil {
		t.Fatalf("query %q on %s: %v", sql, d.name, err)
	}
	if v == nil {
		return ""
	}
	return *v
}

// Connect opens a superuser connection to the database, closed when the
// test ends.
func (d *PGDatabase) Connect(t testing.TB) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), d.DSN())
	if err != nil {
		t.Fatalf("connect to %s: %v", d.name, err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// CurrentLSN is the server's current WAL write position, as text.
func (d *PGDatabase) CurrentLSN(t testing.TB) string {
	t.Helper()
	return d.QueryString(t, "SELECT pg_current_wal_lsn()::text")
}

// ConfirmedFlushLSN is slot's confirmed_flush_lsn as text, or "" when the
// slot does not exist.
func (d *PGDatabase) ConfirmedFlushLSN(t testing.TB, slot string) string {
	t.Helper()
	return d.pg.SlotConfirmedFlushLSN(t, d.name, slot)
}

// LSNAtMost reports a <= b for PostgreSQL's "X/Y" LSN text; an empty or
// unparsable LSN is never <= anything, nor is anything <= it.
func LSNAtMost(a, b string) bool {
	x, err1 := lsn.Parse(a)
	y, err2 := lsn.Parse(b)
	return err1 == nil && err2 == nil && x <= y
}

// CreateDatabase creates database name. If the test then fails, the server
// log lines written since are logged, so tests sharing a cluster still see
// what the server said about their failure.
func (p *Postgres) CreateDatabase(t testing.TB, name string) *PGDatabase {
	t.Helper()
	logFile := p.local.LogFile()
	var logStart int64
	if st, err := os.Stat(logFile); err == nil {
		logStart = st.Size()
	}
	err := p.local.WithConn("postgres", func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
		return err
	})
	if err != nil {
		t.Fatalf("create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		b, err := os.ReadFile(logFile)
		if err != nil || int64(len(b)) < logStart {
			return
		}
		t.Logf("postgres log since database %s was created:\n%s", name, LastLines(string(b[logStart:]), 50))
	})
	return p.DB(name)
}

// CreateTestDatabase creates a database named after the test and unique in
// the cluster, for tests that share one cluster.
func (p *Postgres) CreateTestDatabase(t testing.TB) *PGDatabase {
	t.Helper()
	var b strings.Builder
	for _, r := range strings.ToLower(t.Name()) {
		if b.Len() >= 40 { // identifiers are capped at 63 bytes
			break
		}
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	return p.CreateDatabase(t, fmt.Sprintf("t_%s_%d", b.String(), p.dbSeq.Add(1)))
}

// CreateRelayDatabase is CreateTestDatabase for a test that runs the
// relay: it also returns the replication slot name to use, the database's
// name, because slots are cluster-wide and tests sharing a cluster need
// one each. The slot is dropped when the test ends (DropSlotAtEnd).
func (p *Postgres) CreateRelayDatabase(t testing.TB) (db *PGDatabase, slot string) {
	t.Helper()
	db = p.CreateTestDatabase(t)
	db.DropSlotAtEnd(t, db.Name())
	return db, db.Name()
}

// DropSlotAtEnd drops the replication slot slot, if it exists, when the
// test ends, so a cluster that tests share keeps no WAL for it. A relay the
// test started was killed by its own cleanup, which runs first, but its
// walsender may hold the slot a moment longer: the drop waits up to 15
// seconds for that, and a slot still held then is only logged, so cleanup
// never hides the test's own result.
func (d *PGDatabase) DropSlotAtEnd(t testing.TB, slot string) {
	t.Cleanup(func() {
		var err error
		if !Poll(15*time.Second, func() bool {
			err = d.dropInactiveSlot(slot)
			return err == nil
		}) {
			t.Logf("cleanup: slot %s not dropped: %v", slot, err)
		}
	})
}

// DropSlot drops slot once no walsender holds it. A relay that has just
// exited may leave its walsender holding the slot a moment longer, so the
// drop waits up to 30 seconds for that and fails the test after.
func (d *PGDatabase) DropSlot(t testing.TB, slot string) {
	t.Helper()
	var err error
	if !Poll(30*time.Second, func() bool {
		err = d.dropInactiveSlot(slot)
		return err == nil
	}) {
		t.Fatalf("drop slot %s: %v", slot, err)
	}
}

// dropInactiveSlot drops the slot if it exists and is inactive; it returns
// an error while the slot is still active.
func (d *PGDatabase) dropInactiveSlot(slot string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, d.DSN())
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	var active *bool
	err = conn.QueryRow(ctx, "SELECT active FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&active)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return err
	}
	if active != nil && *active {
		return errors.New("slot still active")
	}
	_, err = conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", slot)
	return err
}

// SlotInfo reads slot's row from pg_replication_slots, connecting to db.
// Slots are cluster-wide; db only chooses where the query runs.
func (p *Postgres) SlotInfo(t testing.TB, db, slot string) SlotInfo {
	t.Helper()
	var si SlotInfo
	err := p.local.WithConn(db, func(ctx context.Context, c *pgx.Conn) error {
		err := c.QueryRow(ctx, `SELECT active, COALESCE(active_pid, 0),
			COALESCE(confirmed_flush_lsn::text, ''), COALESCE(restart_lsn::text, ''),
			COALESCE(wal_status, '')
			FROM pg_replication_slots WHERE slot_name = $1`, slot).
			Scan(&si.Active, &si.ActivePID, &si.ConfirmedFlush, &si.RestartLSN, &si.WALStatus)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		si.Exists = err == nil
		return err
	})
	if err != nil {
		t.Fatalf("slot info %s: %v", slot, err)
	}
	return si
}

// SlotConfirmedFlushLSN returns slot's confirmed_flush_lsn in text form, or
// "" when the slot does not exist (or is physical).
func (p *Postgres) SlotConfirmedFlushLSN(t testing.TB, db, slot string) string {
	t.Helper()
	return p.SlotInfo(t, db, slot).ConfirmedFlush
}

// SharedPostgres is one cluster for the tests of a package that need no
// special settings, started on first use and stopped by Main; each test
// takes a database of its own. Declare it as a package variable.
type SharedPostgres struct {
	once sync.Once
	pg   *Postgres
	err  error
}

// Get starts the cluster on first use, failing the test if it cannot.
func (s *SharedPostgres) Get(t testing.TB) *Postgres {
	t.Helper()
	s.once.Do(func() { s.pg, _, s.err = StartPostgresMain(PGOptions{}) })
	if s.err != nil {
		t.Fatalf("start the shared postgres: %v", s.err)
	}
	return s.pg
}

// StatementCounter is a pgx tracer that counts the statements a
// connection sends; without pipelining each is one round trip. Set it as
// pgx.ConnConfig.Tracer.
type StatementCounter struct{ n atomic.Int64 }

// Count is how many statements were sent so far.
func (c *StatementCounter) Count() int64 { return c.n.Load() }

// TraceQueryStart implements pgx.QueryTracer.
func (c *StatementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

// TraceQueryEnd implements pgx.QueryTracer.
func (c *StatementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
