package throwaway

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"

	"github.com/jackc/pgx/v5"
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
// Close stops the copy and deletes it, as p's Services do when they close.
func (p *Postgres) BaseBackup(standby bool) (_ *Postgres, err error) {
	c, err := p.services.newClusterDir(p.bin, p.runAs)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.Close()
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
func (p *Postgres) StartNew() error {
	return p.startFresh()
}

// Promote ends a standby's recovery (pg_ctl promote) and waits until it
// accepts writes, on a new timeline.
func (p *Postgres) Promote() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if out, err := p.pgRun("pg_ctl", "promote", "-D", p.dataDir, "-w", "-t", "90", "-s"); err != nil {
		return fmt.Errorf("pg_ctl promote: %w: %s\nlog tail:\n%s", err, out, p.LogTail(20))
	}
	return nil
}

// CopyStandby makes a streaming standby of p without pg_basebackup, which
// the fetched 16-18 servers come without: it creates the physical slot
// physSlot on p, stops p cleanly, copies its data directory, and starts p
// again and the copy as its standby, streaming from physSlot under the
// application_name physSlot (so synchronous_standby_names may name it).
// settings go into the standby's own configuration, after the defaults:
// e.g. sync_replication_slots and hot_standby_feedback for failover slots.
// The primary's synchronized_standby_slots is cleared there, or a promoted
// standby would wait for a slot it does not have.
//
// Close stops the standby and deletes it, as p's Services do when they
// close.
func (p *Postgres) CopyStandby(physSlot string, settings map[string]string) (_ *Postgres, err error) {
	if err := p.WithConn("postgres", func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, "SELECT pg_create_physical_replication_slot($1)", physSlot)
		return err
	}); err != nil {
		return nil, fmt.Errorf("create physical slot %s: %w", physSlot, err)
	}
	major, err := p.Major()
	if err != nil {
		return nil, err
	}
	if err := p.Stop(); err != nil {
		return nil, fmt.Errorf("stop the primary: %w", err)
	}
	c, err := p.copyDataDir(physSlot, settings, major)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	if err := p.Start(); err != nil {
		return nil, fmt.Errorf("start the primary again: %w", err)
	}
	if err := c.StartNew(); err != nil {
		return nil, fmt.Errorf("start the standby: %w", err)
	}
	return c, nil
}

// copyDataDir copies p's stopped data directory into a new cluster
// configured as a standby of p streaming from physSlot.
func (p *Postgres) copyDataDir(physSlot string, settings map[string]string, major int) (_ *Postgres, err error) {
	c, err := p.services.newClusterDir(p.bin, p.runAs)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.Close()
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
