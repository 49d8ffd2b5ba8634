package throwaway

import (
	"context"
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
	"time"

	"github.com/jackc/pgx/v5"
)

// PGBinEnv names the environment variable that, when set, points at the
// directory holding initdb, pg_ctl and postgres. Without it the newest
// /usr/lib/postgresql/<version>/bin is used, then whatever pg_ctl is on PATH.
const PGBinEnv = "OUTBOX_RELAY_PG_BIN"

// pgDirPrefix marks temporary directories that hold a cluster, so a later
// process can find and stop clusters orphaned by a killed one.
const pgDirPrefix = "outbox-relay-pg-"

// pgCmdTimeout bounds every initdb/pg_ctl invocation; a cold initdb on a
// loaded two-core machine takes a few seconds, crash recovery a few more.
const pgCmdTimeout = 2 * time.Minute

// PGOptions configures a cluster started by StartPostgres.
type PGOptions struct {
	// Settings are postgresql.conf parameters applied after the
	// defaults, so they override them (e.g. "wal_level": "replica") or
	// add new ones (e.g. "max_slot_wal_keep_size": "64MB"). They persist
	// across Stop/Start/Restart.
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
// methods are safe for concurrent use.
type Postgres struct {
	services *Services
	bin      string
	dir      string
	dataDir  string
	// dataDirReal is dataDir with symlinks resolved, as /proc shows it.
	dataDirReal string
	sockDir     string
	logFile     string
	runAs       *osUser

	unregister func()
	closeOnce  sync.Once

	mu   sync.Mutex // serialises starting and stopping
	port atomic.Int64
}

// osUser is the account initdb and postgres run as when the caller runs as
// root, because both refuse to run as root.
type osUser struct {
	name     string
	uid, gid int
}

// StartPostgres initialises and starts a new cluster. Close stops it
// (immediate mode) and deletes its files; so does s.Close, for a cluster
// still running then.
func (s *Services) StartPostgres(opts PGOptions) (_ *Postgres, err error) {
	bin, err := s.pgBinDir()
	if err != nil {
		return nil, err
	}
	var runAs *osUser
	if os.Geteuid() == 0 {
		if runAs, err = lookupUser("postgres"); err != nil {
			return nil, fmt.Errorf("running as root needs the postgres user: %w", err)
		}
	}
	p, err := s.newClusterDir(bin, runAs)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			p.Close()
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
		got, err := p.Major()
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
func (p *Postgres) Major() (int, error) {
	var num int
	err := p.WithConn("postgres", func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&num)
	})
	if err != nil {
		return 0, fmt.Errorf("server version: %w", err)
	}
	return num / 10000, nil
}

// newClusterDir makes the directories of a cluster that has no data yet,
// owned by runAs, and registers the cluster with s before anything can
// start, so that a failure half-way, a panic or an interrupt still stops
// the server and removes the files.
func (s *Services) newClusterDir(bin string, runAs *osUser) (_ *Postgres, err error) {
	// A test's t.TempDir() lives under a 0700 root-owned parent the
	// postgres user cannot enter, so the cluster gets its own directory
	// under TMPDIR.
	dir, err := MakeOwnedTempDir(pgDirPrefix)
	if err != nil {
		return nil, err
	}
	p := &Postgres{
		services: s,
		bin:      bin,
		dir:      dir,
		dataDir:  filepath.Join(dir, "data"),
		sockDir:  filepath.Join(dir, "sock"),
		logFile:  filepath.Join(dir, "postgres.log"),
		runAs:    runAs,
	}
	p.unregister = s.OnClose(p.Close)
	defer func() {
		if err != nil {
			p.Close()
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

// settings returns the server parameters in a stable order, defaults first
// so that the caller's settings, written later, win.
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
		port, perr := FreePort()
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
// this package did, so that Start works after a test killed the postmaster.
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
func (p *Postgres) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.startLocked()
}

// Stop shuts the cluster down in fast mode: sessions, walsenders included,
// are terminated and a shutdown checkpoint is written.
func (p *Postgres) Stop() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopLocked("fast")
}

// StopImmediate stops the cluster the way a crash would: no checkpoint, so
// the next Start replays WAL.
func (p *Postgres) StopImmediate() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopLocked("immediate")
}

// ResetWAL runs pg_resetwal with args on the stopped cluster's data
// directory, e.g. "-e", "1" to move the transaction id epoch on.
func (p *Postgres) ResetWAL(args ...string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.serverRunning() {
		return fmt.Errorf("pg_resetwal: the server is running; stop it first")
	}
	if out, err := p.pgRun("pg_resetwal", append(args, "-D", p.dataDir)...); err != nil {
		return fmt.Errorf("pg_resetwal %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

// Restart is Stop followed by Start.
func (p *Postgres) Restart() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stopLocked("fast"); err != nil {
		return err
	}
	return p.startLocked()
}

// Close stops the server however it can and deletes its files. It is safe
// to call more than once, and concurrently with the Services' Close.
func (p *Postgres) Close() {
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

// LogFile is the path of the server log.
func (p *Postgres) LogFile() string { return p.logFile }

// PostmasterPID is the running postmaster's pid, from postmaster.pid.
func (p *Postgres) PostmasterPID() (int, error) {
	return postmasterPID(p.dataDir)
}

// KillPostmaster SIGKILLs the postmaster and returns once it is dead: a
// harsher crash than StopImmediate, as nobody tells the backends. Start
// afterwards waits for the orphaned backends to go and runs crash
// recovery.
func (p *Postgres) KillPostmaster() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	pid, err := postmasterPID(p.dataDir)
	if err != nil || !p.serverRunning() {
		return fmt.Errorf("server not running (%v)", err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return err
	}
	// The signal is asynchronous; until the process is gone, Start
	// would take the dying server for a running one.
	if !Poll(10*time.Second, func() bool { return !processAlive(pid) }) {
		return fmt.Errorf("pid %d still alive after SIGKILL", pid)
	}
	return nil
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

// WithConn runs fn on a fresh superuser connection to db, with 30 seconds
// for the whole call. A connection per call stays correct across restarts
// and leaves no session behind to block DROP DATABASE or a fast shutdown.
func (p *Postgres) WithConn(db string, fn func(context.Context, *pgx.Conn) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.DSN(db))
	if err != nil {
		return fmt.Errorf("connect to %s: %w", db, err)
	}
	defer conn.Close(context.Background())
	return fn(ctx, conn)
}

// pgBinDir finds the directory with initdb, pg_ctl and postgres.
func (s *Services) pgBinDir() (string, error) {
	if major, err := RequestedPGMajor(); err != nil || major != 0 {
		if err != nil {
			return "", err
		}
		return s.versionedPGBinDir(major)
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
