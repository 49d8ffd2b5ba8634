package harness

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// PGBinEnv names the environment variable that, when set, points at the
// directory holding initdb, pg_ctl and postgres. Without it the newest
// /usr/lib/postgresql/<version>/bin is used, then whatever pg_ctl is on PATH.
const PGBinEnv = "OUTBOX_RELAY_PG_BIN"

// pgDirPrefix marks temporary directories that hold a harness cluster, so a
// later test binary can find and stop clusters orphaned by a killed one.
const pgDirPrefix = "outbox-relay-pg-"

// pgCmdTimeout bounds every initdb/pg_ctl invocation; a cold initdb on a
// loaded two-core machine takes a few seconds, crash recovery a few more.
const pgCmdTimeout = 2 * time.Minute

// PGOptions configures a cluster started by StartPostgres.
type PGOptions struct {
	// Settings are postgresql.conf parameters applied after the harness
	// defaults, so they override them (e.g. "wal_level": "replica") or add
	// new ones (e.g. "max_slot_wal_keep_size": "64MB"). They persist across
	// Stop/Start/Restart.
	Settings map[string]string

	// PasswordAuth makes TCP connections of every role except the postgres
	// superuser authenticate with scram-sha-256, so a test can create a
	// minimal role with a password and prove the relay gets by with it.
	PasswordAuth bool

	// SynchronousCommitOff sets synchronous_commit=off for faster commits.
	// A crash (StopImmediate) can then lose recently acknowledged
	// transactions, so leave it unset for crash drills.
	SynchronousCommitOff bool
}

// Postgres is a throwaway PostgreSQL cluster listening on 127.0.0.1. All
// methods are safe for concurrent use, so parallel tests can share one
// cluster and each use its own database.
type Postgres struct {
	bin     string
	dir     string
	dataDir string
	// dataDirReal is dataDir with symlinks resolved, as /proc shows it.
	dataDirReal string
	sockDir     string
	logFile     string
	runAs       *osUser

	dbSeq      atomic.Int64
	unregister func()
	closeOnce  sync.Once

	mu   sync.Mutex // serialises starting and stopping
	port atomic.Int64
}

// osUser is the account initdb and postgres run as when the harness itself
// runs as root, because both refuse to run as root.
type osUser struct {
	name     string
	uid, gid int
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
	p, err := newPostgres(opts)
	if err != nil {
		t.Fatalf("start postgres: %v", err)
	}
	p.closeWithTest(t, "postgres")
	return p
}

// StartPostgresMain is StartPostgres for TestMain, where there is no
// testing.TB: it returns the cluster and a function that stops it and
// deletes its files. Main also calls that function after the tests run, so
// a TestMain that uses Main may ignore it.
func StartPostgresMain(opts PGOptions) (*Postgres, func(), error) {
	p, err := newPostgres(opts)
	if err != nil {
		return nil, nil, err
	}
	return p, p.close, nil
}

func newPostgres(opts PGOptions) (_ *Postgres, err error) {
	bin, err := pgBinDir()
	if err != nil {
		return nil, err
	}
	var runAs *osUser
	if os.Geteuid() == 0 {
		if runAs, err = lookupUser("postgres"); err != nil {
			return nil, fmt.Errorf("running as root needs the postgres user: %w", err)
		}
	}
	p, err := newClusterDir(bin, runAs)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	if out, err := p.pgRun("initdb", "-D", p.dataDir, "--auth=trust", "-U", "postgres",
		"--encoding=UTF8", "--locale=C", "--no-sync"); err != nil {
		return nil, fmt.Errorf("initdb: %w: %s", err, out)
	}
	if err := p.writeHBA(opts.PasswordAuth); err != nil {
		return nil, err
	}
	if err := p.appendConf(p.settings(opts)); err != nil {
		return nil, err
	}
	if err := p.startFresh(); err != nil {
		return nil, err
	}
	if want, _ := RequestedPGMajor(); want != 0 {
		// A wrong server here would pass every test while proving nothing
		// about the version asked for.
		got, err := p.major()
		if err != nil {
			return nil, err
		}
		if got != want {
			return nil, fmt.Errorf("%s=%d, but the server in %s is PostgreSQL %d", PGVersionEnv, want, bin, got)
		}
	}
	return p, nil
}

// Major is the server's major version (15, 16, ...).
func (p *Postgres) Major(t testing.TB) int {
	t.Helper()
	v, err := p.major()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func (p *Postgres) major() (int, error) {
	var num int
	err := p.withConn("postgres", func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&num)
	})
	if err != nil {
		return 0, fmt.Errorf("server version: %w", err)
	}
	return num / 10000, nil
}

// newClusterDir makes the directories of a cluster that has no data yet,
// owned by runAs, and registers the cluster for cleanup before anything can
// start, so that a failure half-way, a panic or an interrupt still stops
// the server and removes the files.
func newClusterDir(bin string, runAs *osUser) (_ *Postgres, err error) {
	// t.TempDir() lives under a 0700 root-owned parent the postgres user
	// cannot enter, so the cluster gets its own directory under TMPDIR.
	dir, err := makeOwnedTempDir(pgDirPrefix)
	if err != nil {
		return nil, err
	}
	p := &Postgres{
		bin:     bin,
		dir:     dir,
		dataDir: filepath.Join(dir, "data"),
		sockDir: filepath.Join(dir, "sock"),
		logFile: filepath.Join(dir, "postgres.log"),
		runAs:   runAs,
	}
	p.unregister = registerCleanup(p.close)
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	p.dataDirReal = p.dataDir
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		p.dataDirReal = filepath.Join(real, "data")
	}
	if err := os.Mkdir(p.sockDir, 0o700); err != nil {
		return nil, fmt.Errorf("create socket dir: %w", err)
	}
	if runAs != nil {
		for _, d := range []string{dir, p.sockDir} {
			if err := os.Chown(d, runAs.uid, runAs.gid); err != nil {
				return nil, fmt.Errorf("chown %s: %w", d, err)
			}
		}
	}
	return p, nil
}

// settings returns the server parameters in a stable order, harness defaults
// first so that the caller's settings, written later, win.
func (p *Postgres) settings(opts PGOptions) [][2]string {
	kv := [][2]string{
		{"listen_addresses", "127.0.0.1"},
		{"unix_socket_directories", p.sockDir},
		{"wal_level", "logical"},
		{"max_wal_senders", "20"},
		{"max_replication_slots", "20"},
		{"shared_buffers", "64MB"},
		{"log_min_messages", "warning"},
	}
	if opts.SynchronousCommitOff {
		kv = append(kv, [2]string{"synchronous_commit", "off"})
	}
	keys := make([]string, 0, len(opts.Settings))
	for k := range opts.Settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		kv = append(kv, [2]string{k, opts.Settings[k]})
	}
	return kv
}

func (p *Postgres) appendConf(kv [][2]string) error {
	var b strings.Builder
	b.WriteString("\n# outbox-relay test harness\ninclude_if_exists = 'harness_port.conf'\n")
	for _, s := range kv {
		fmt.Fprintf(&b, "%s = '%s'\n", s[0], strings.ReplaceAll(s[1], "'", "''"))
	}
	f, err := os.OpenFile(filepath.Join(p.dataDir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("open postgresql.conf: %w", err)
	}
	if _, err := f.WriteString(b.String()); err != nil {
		f.Close()
		return fmt.Errorf("write postgresql.conf: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write postgresql.conf: %w", err)
	}
	return nil
}

// writeHBA replaces initdb's pg_hba.conf. The superuser always gets in
// without a password (the harness and tests connect as it); PasswordAuth
// only tightens every other role.
func (p *Postgres) writeHBA(passwordAuth bool) error {
	other := "trust"
	if passwordAuth {
		other = "scram-sha-256"
	}
	hba := "local all all trust\n" +
		"local replication all trust\n" +
		"host all postgres 127.0.0.1/32 trust\n" +
		"host replication postgres 127.0.0.1/32 trust\n" +
		"host all all 127.0.0.1/32 " + other + "\n" +
		"host replication all 127.0.0.1/32 " + other + "\n"
	return p.writeOwned(filepath.Join(p.dataDir, "pg_hba.conf"), hba)
}

// writeOwned writes a file the server must read; files root creates would
// be unreadable to the postgres user.
func (p *Postgres) writeOwned(path, content string) error {
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	if p.runAs != nil {
		if err := os.Chown(path, p.runAs.uid, p.runAs.gid); err != nil {
			return fmt.Errorf("chown %s: %w", filepath.Base(path), err)
		}
	}
	return nil
}

// startFresh picks a port and starts the server, picking another port when
// the chosen one was taken between FreePort and the bind: parallel test
// binaries race for ports all the time.
func (p *Postgres) startFresh() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		port, perr := freePort()
		if perr != nil {
			return fmt.Errorf("free port: %w", perr)
		}
		if err = p.writeOwned(filepath.Join(p.dataDir, "harness_port.conf"),
			fmt.Sprintf("port = %d\n", port)); err != nil {
			return err
		}
		p.port.Store(int64(port))
		if err = p.startLocked(); err == nil {
			return nil
		}
		if !strings.Contains(p.LogTail(20), "could not bind") {
			return err
		}
	}
	return err
}

// serverRunning looks at the server itself rather than remembering what
// the harness did, so that Start works after a test killed the postmaster.
func (p *Postgres) serverRunning() bool {
	pid, err := postmasterPID(p.dataDir)
	if err != nil || !processAlive(pid) {
		return false
	}
	if procAvailable() {
		// Precise even if the pid was reused: every postgres process
		// runs with the data directory as its working directory.
		return p.inDataDir(pid)
	}
	return isPostgres(pid)
}

func (p *Postgres) inDataDir(pid int) bool {
	cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
	return err == nil && cwd == p.dataDirReal
}

// serverProcs lists the processes still working in the data directory: a
// running server, or what a killed postmaster left behind. Zombies have no
// working directory and do not count.
func (p *Postgres) serverProcs() []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err == nil && p.inDataDir(pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

func (p *Postgres) startLocked() error {
	if p.serverRunning() {
		return nil
	}
	if procAvailable() {
		// After a postmaster was SIGKILLed its children linger until
		// they notice, and PostgreSQL refuses to start while they
		// hold the old shared memory.
		if !Poll(30*time.Second, func() bool { return len(p.serverProcs()) == 0 }) {
			return fmt.Errorf("processes of the previous server still running: %v", p.serverProcs())
		}
	}
	// A dead but unreaped postmaster still passes PostgreSQL's own lock
	// file checks (kill(pid, 0)), so its lock files must go.
	locks, _ := filepath.Glob(filepath.Join(p.sockDir, ".s.PGSQL.*.lock"))
	for _, lock := range append(locks, filepath.Join(p.dataDir, "postmaster.pid")) {
		if pid, err := lockFilePID(lock); err == nil && !processAlive(pid) {
			_ = os.Remove(lock)
		}
	}
	out, err := p.pgRun("pg_ctl", "start", "-D", p.dataDir, "-l", p.logFile, "-w", "-t", "90", "-s")
	if err != nil {
		return fmt.Errorf("pg_ctl start: %w: %s\nlog tail:\n%s", err, out, p.LogTail(20))
	}
	return nil
}

func (p *Postgres) stopLocked(mode string) error {
	if !p.serverRunning() {
		return nil
	}
	out, err := p.pgRun("pg_ctl", "stop", "-D", p.dataDir, "-m", mode, "-w", "-t", "90", "-s")
	if err != nil {
		return fmt.Errorf("pg_ctl stop -m %s: %w: %s", mode, err, out)
	}
	return nil
}

// Start starts a stopped cluster on the same port, with the same settings;
// it does nothing if the server is running. After StopImmediate or
// KillPostmaster this runs crash recovery.
func (p *Postgres) Start(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.startLocked(); err != nil {
		t.Fatalf("start postgres: %v", err)
	}
}

// Stop shuts the cluster down in fast mode: sessions, walsenders included,
// are terminated and a shutdown checkpoint is written.
func (p *Postgres) Stop(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stopLocked("fast"); err != nil {
		t.Fatalf("stop postgres: %v", err)
	}
}

// StopImmediate stops the cluster the way a crash would: no checkpoint, so
// the next Start replays WAL.
func (p *Postgres) StopImmediate(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stopLocked("immediate"); err != nil {
		t.Fatalf("stop postgres immediately: %v", err)
	}
}

// Restart is Stop followed by Start.
func (p *Postgres) Restart(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stopLocked("fast"); err != nil {
		t.Fatalf("restart postgres: %v", err)
	}
	if err := p.startLocked(); err != nil {
		t.Fatalf("restart postgres: %v", err)
	}
}

// close stops the server however it can and deletes its files. It is safe
// to call more than once and from the cleanup registry.
func (p *Postgres) close() {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		if err := p.stopLocked("immediate"); err != nil {
			// pg_ctl failed (binary gone, wedged server): make sure
			// no postmaster outlives us anyway.
			killPostmaster(p.dataDir)
		}
		p.mu.Unlock()
		os.RemoveAll(p.dir)
		if p.unregister != nil {
			p.unregister()
		}
	})
}

// pgRun runs one of the PostgreSQL programs, as the postgres user when we
// are root. Output goes through a file rather than a pipe: pg_ctl start
// leaves a postmaster behind, and a pipe it inherited would keep Wait from
// returning.
func (p *Postgres) pgRun(prog string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), pgCmdTimeout)
	defer cancel()
	path := filepath.Join(p.bin, prog)
	var cmd *exec.Cmd
	if p.runAs != nil {
		cmd = exec.CommandContext(ctx, "runuser", append([]string{"-u", p.runAs.name, "--", path}, args...)...)
	} else {
		cmd = exec.CommandContext(ctx, path, args...)
	}
	cmd.Dir = p.dir
	cmd.Env = append(os.Environ(), "LC_ALL=C", "LANG=C")
	out, err := os.CreateTemp(p.dir, "cmd-*.out")
	if err != nil {
		return "", fmt.Errorf("capture %s output: %w", prog, err)
	}
	defer os.Remove(out.Name())
	defer out.Close()
	cmd.Stdout, cmd.Stderr = out, out
	cmd.WaitDelay = 5 * time.Second
	runErr := cmd.Run()
	b, _ := os.ReadFile(out.Name())
	return strings.TrimSpace(string(b)), runErr
}

// Port is the TCP port the cluster listens on; it stays the same across
// Stop/Start/Restart.
func (p *Postgres) Port() int { return int(p.port.Load()) }

// DSN is a postgres:// URL for the superuser postgres and database db.
func (p *Postgres) DSN(db string) string {
	return p.dsn(url.User("postgres"), db)
}

// DSNFor is a postgres:// URL for user with password on database db.
func (p *Postgres) DSNFor(user, password, db string) string {
	return p.dsn(url.UserPassword(user, password), db)
}

func (p *Postgres) dsn(u *url.Userinfo, db string) string {
	return (&url.URL{
		Scheme:   "postgres",
		User:     u,
		Host:     fmt.Sprintf("127.0.0.1:%d", p.Port()),
		Path:     "/" + db,
		RawQuery: "sslmode=disable",
	}).String()
}

// DataDir is the cluster's data directory.
func (p *Postgres) DataDir() string { return p.dataDir }

// PostmasterPID is the running postmaster's pid, from postmaster.pid; it
// fails the test when the server is not running.
func (p *Postgres) PostmasterPID(t testing.TB) int {
	t.Helper()
	pid, err := postmasterPID(p.dataDir)
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
	p.mu.Lock()
	defer p.mu.Unlock()
	pid, err := postmasterPID(p.dataDir)
	if err != nil || !p.serverRunning() {
		t.Fatalf("kill postmaster: server not running (%v)", err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill postmaster: %v", err)
	}
	// The signal is asynchronous; until the process is gone, Start
	// would take the dying server for a running one.
	if !Poll(10*time.Second, func() bool { return !processAlive(pid) }) {
		t.Fatalf("kill postmaster: pid %d still alive after SIGKILL", pid)
	}
}

func postmasterPID(dataDir string) (int, error) {
	return lockFilePID(filepath.Join(dataDir, "postmaster.pid"))
}

// lockFilePID reads the pid on the first line of a PostgreSQL lock file
// (postmaster.pid, or a socket's .lock).
func lockFilePID(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("bad lock file %s: %q", filepath.Base(path), first)
	}
	return pid, nil
}

// LogTail returns the last n lines of the server log.
func (p *Postgres) LogTail(n int) string {
	b, err := os.ReadFile(p.logFile)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return LastLines(string(b), n)
}

func (p *Postgres) connect(ctx context.Context, db string) (*pgx.Conn, error) {
	conn, err := pgx.Connect(ctx, p.DSN(db))
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", db, err)
	}
	return conn, nil
}

// withConn runs fn on a fresh connection to db. A connection per call keeps
// the helpers correct across restarts and leaves no session behind to block
// DROP DATABASE or a fast shutdown.
func (p *Postgres) withConn(db string, fn func(context.Context, *pgx.Conn) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := p.connect(ctx, db)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return fn(ctx, conn)
}

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
	err := d.pg.withConn(d.name, func(ctx context.Context, c *pgx.Conn) error {
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
	err := d.pg.withConn(d.name, func(ctx context.Context, c *pgx.Conn) error {
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
	err := d.pg.withConn(d.name, func(ctx context.Context, c *pgx.Conn) error {
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
	var logStart int64
	if st, err := os.Stat(p.logFile); err == nil {
		logStart = st.Size()
	}
	err := p.withConn("postgres", func(ctx context.Context, c *pgx.Conn) error {
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
		b, err := os.ReadFile(p.logFile)
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

// SlotInfo reads slot's row from pg_replication_slots, connecting to db.
// Slots are cluster-wide; db only chooses where the query runs.
func (p *Postgres) SlotInfo(t testing.TB, db, slot string) SlotInfo {
	t.Helper()
	var si SlotInfo
	err := p.withConn(db, func(ctx context.Context, c *pgx.Conn) error {
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

// pgBinDir finds the directory with initdb, pg_ctl and postgres.
func pgBinDir() (string, error) {
	if major, err := RequestedPGMajor(); err != nil || major != 0 {
		if err != nil {
			return "", err
		}
		return versionedPGBinDir(major)
	}
	if d := os.Getenv(PGBinEnv); d != "" {
		return d, nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	best, bestVer := "", -1.0
	for _, d := range dirs {
		v, err := strconv.ParseFloat(filepath.Base(filepath.Dir(d)), 64)
		if err != nil {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil && v > bestVer {
			best, bestVer = d, v
		}
	}
	if best != "" {
		return best, nil
	}
	// Distributions put symlinks on PATH; pg_ctl finds postgres next to
	// its real location, and so must we.
	path, err := exec.LookPath("pg_ctl")
	if err != nil {
		return "", fmt.Errorf("find postgresql binaries (set %s): %w", PGBinEnv, err)
	}
	if real, err := filepath.EvalSymlinks(path); err == nil {
		path = real
	}
	return filepath.Dir(path), nil
}

func lookupUser(name string) (*osUser, error) {
	u, err := user.Lookup(name)
	if err != nil {
		return nil, err
	}
	uid, err := strconv.Atoi(u.Uid)
	if err != nil {
		return nil, fmt.Errorf("uid of %s: %w", name, err)
	}
	gid, err := strconv.Atoi(u.Gid)
	if err != nil {
		return nil, fmt.Errorf("gid of %s: %w", name, err)
	}
	return &osUser{name: name, uid: uid, gid: gid}, nil
}

// killPostmaster stops the postmaster recorded in dataDir's postmaster.pid,
// if it is still a live postgres process, the way pg_ctl stop -m immediate
// does (SIGQUIT), escalating to SIGKILL. It needs neither pg_ctl nor the
// postgres user, so it works on clusters left behind by other runs.
func killPostmaster(dataDir string) {
	pid, err := postmasterPID(dataDir)
	if err != nil || !isPostgres(pid) {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGQUIT)
	if Poll(10*time.Second, func() bool { return !processAlive(pid) }) {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	Poll(5*time.Second, func() bool { return !processAlive(pid) })
}

// isPostgres guards against signalling an unrelated process that reused a
// dead postmaster's pid.
func isPostgres(pid int) bool {
	comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		return processAlive(pid) && !procAvailable()
	}
	return strings.TrimSpace(string(comm)) == "postgres"
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
