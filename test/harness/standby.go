package harness

import "testing"

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
	c, err := p.local.BaseBackup(standby)
	if err != nil {
		t.Fatalf("base backup: %v", err)
	}
	return closeWithTest(t, c, "backup cluster")
}

// StartNew starts a cluster made by BaseBackup on a free port of its own.
func (p *Postgres) StartNew(t testing.TB) {
	t.Helper()
	if err := p.local.StartNew(); err != nil {
		t.Fatalf("start the backup cluster: %v", err)
	}
}

// Promote ends a standby's recovery (pg_ctl promote) and waits until it
// accepts writes, on a new timeline.
func (p *Postgres) Promote(t testing.TB) {
	t.Helper()
	if err := p.local.Promote(); err != nil {
		t.Fatal(err)
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
	c, err := p.local.CopyStandby(physSlot, settings)
	if err != nil {
		t.Fatalf("standby by copy: %v", err)
	}
	return closeWithTest(t, c, "standby")
}
