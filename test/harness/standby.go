package harness

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"testing"
)

// BaseBackup takes a base backup of p with pg_basebackup (fast checkpoint,
// WAL streamed along) into a directory of its own and returns it as a
// cluster that is not running yet; start it with StartNew. The copy keeps
// p's system identifier and settings, not its replication slots.
//
// With standby, the copy is a streaming standby of p (pg_basebackup -R):
// started, it follows p until Promote. Without, starting it is restoring
// the backup: it recovers to the end of the backup and becomes a primary
// on p's timeline, behind p by everything written since the backup.
//
// The copy is stopped and deleted when the test ends.
func (p *Postgres) BaseBackup(t testing.TB, standby bool) *Postgres {
	t.Helper()
	c, err := p.baseBackup(standby)
	if err != nil {
		t.Fatalf("base backup: %v", err)
	}
	c.closeWithTest(t, "backup cluster")
	return c
}

// closeWithTest stops and deletes the cluster when the test ends, logging
// the tail of its server log if the test failed.
func (p *Postgres) closeWithTest(t testing.TB, what string) {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s log tail (%s):\n%s", what, p.logFile, p.LogTail(50))
		}
		p.close()
	})
}

func (p *Postgres) baseBackup(standby bool) (_ *Postgres, err error) {
	c, err := newClusterDir(p.bin, p.runAs)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	args := []string{"-D", c.dataDir, "-h", "127.0.0.1", "-p", strconv.Itoa(p.Port()), "-U", "postgres",
		"-X", "stream", "-c", "fast", "--no-sync"}
	if standby {
		args = append(args, "-R")
	}
	if out, err := c.pgRun("pg_basebackup", args...); err != nil {
		return nil, fmt.Errorf("pg_basebackup: %w: %s", err, out)
	}
	// postgresql.auto.conf is read last, so this overrides the primary's
	// socket directory copied with postgresql.conf; the port comes from
	// harness_port.conf, which StartNew rewrites.
	auto := filepath.Join(c.dataDir, "postgresql.auto.conf")
	prev, err := os.ReadFile(auto)
	if err != nil {
		return nil, fmt.Errorf("read postgresql.auto.conf: %w", err)
	}
	if err := c.writeOwned(auto, string(prev)+fmt.Sprintf("\nunix_socket_directories = '%s'\n", c.sockDir)); err != nil {
		return nil, err
	}
	return c, nil
}

// StartNew starts a cluster made by BaseBackup on a free port of its own.
func (p *Postgres) StartNew(t testing.TB) {
	t.Helper()
	if err := p.startFresh(); err != nil {
		t.Fatalf("start the backup cluster: %v", err)
	}
}

// Promote ends a standby's recovery (pg_ctl promote) and waits until it
// accepts writes, on a new timeline.
func (p *Postgres) Promote(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if out, err := p.pgRun("pg_ctl", "promote", "-D", p.dataDir, "-w", "-t", "90", "-s"); err != nil {
		t.Fatalf("pg_ctl promote: %v: %s\nlog tail:\n%s", err, out, p.LogTail(20))
	}
}

// CopyStandby makes a streaming standby of p without pg_basebackup, which
// the fetched 16-18 servers come without: it creates the physical slot
// physSlot on p, stops p cleanly, copies its data directory, and starts p
// again and the copy as its standby, streaming from physSlot under the
// application_name physSlot (so synchronous_standby_names may name it).
// settings go into the standby's own configuration, after the harness's:
// e.g. sync_replication_slots and hot_standby_feedback for failover slots.
// The primary's synchronized_standby_slots is cleared there, or a promoted
// standby would wait for a slot it does not have.
//
// The standby is stopped and deleted when the test ends.
func (p *Postgres) CopyStandby(t testing.TB, physSlot string, settings map[string]string) *Postgres {
	t.Helper()
	p.Exec(t, "SELECT pg_create_physical_replication_slot($1)", physSlot)
	major := p.Major(t)
	p.Stop(t)
	c, err := p.copyStandby(physSlot, settings, major)
	if err != nil {
		t.Fatalf("standby by copy: %v", err)
	}
	c.closeWithTest(t, "standby")
	p.Start(t)
	c.StartNew(t)
	return c
}

func (p *Postgres) copyStandby(physSlot string, settings map[string]string, major int) (_ *Postgres, err error) {
	c, err := newClusterDir(p.bin, p.runAs)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	if out, err := exec.Command("cp", "-a", p.dataDir, c.dataDir).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("copy the data directory: %w: %s", err, out)
	}
	// The copy must not believe it runs, nor own the primary's slots.
	if err := os.Remove(filepath.Join(c.dataDir, "postmaster.pid")); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	slots, err := filepath.Glob(filepath.Join(c.dataDir, "pg_replslot", "*"))
	if err != nil {
		return nil, err
	}
	for _, s := range slots {
		if err := os.RemoveAll(s); err != nil {
			return nil, err
		}
	}
	if err := c.writeOwned(filepath.Join(c.dataDir, "standby.signal"), ""); err != nil {
		return nil, err
	}
	conf := fmt.Sprintf("\nunix_socket_directories = '%s'\n", c.sockDir) +
		// dbname: slot synchronisation connects to a database.
		fmt.Sprintf("primary_conninfo = 'host=127.0.0.1 port=%d user=postgres dbname=postgres application_name=%s'\n", p.Port(), physSlot) +
		fmt.Sprintf("primary_slot_name = '%s'\n", physSlot) +
		"synchronous_standby_names = ''\n"
	if major >= 17 {
		conf += "synchronized_standby_slots = ''\n"
	}
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		conf += fmt.Sprintf("%s = '%s'\n", k, settings[k])
	}
	auto := filepath.Join(c.dataDir, "postgresql.auto.conf")
	prev, err := os.ReadFile(auto)
	if err != nil {
		return nil, fmt.Errorf("read postgresql.auto.conf: %w", err)
	}
	if err := c.writeOwned(auto, string(prev)+conf); err != nil {
		return nil, err
	}
	return c, nil
}
