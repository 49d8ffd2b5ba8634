package pg

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// A WAL relay and a poller on one table each publish every event: both
// running at once sends everything twice, with nothing to tell a consumer
// why. Each source therefore looks for the other before it starts, in what
// PostgreSQL knows of live sessions, so a dead process never blocks one.
// The checks are here, beside neither source, because each is about both.

// pollerLockClass is the first key of the advisory lock a poller holds on
// its session while it polls a table; the second is the outbox table's
// OID. It is "poll" in ASCII, which is how it reads in pg_locks.
const pollerLockClass = 1886350444

// modesDoc is where an operator reads how to switch without loss.
const modesDoc = `"Switching between the two" in docs/polling-or-cdc.md`

// HoldPollerLock takes, on conn's session, the shared advisory lock that
// tells a WAL relay a poller runs on cfg.Table. Shared, so pollers never
// wait for one another; it ends with the session, so a poller that died
// holds it no more.
func HoldPollerLock(ctx context.Context, conn *pgx.Conn, cfg Config) error {
	table, err := cfg.QuotedTable()
	if err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock_shared($1, to_regclass($2)::oid::int)", pollerLockClass, table); err != nil {
		return fmt.Errorf("take the poller's advisory lock on %s: %w", cfg.Table, err)
	}
	return nil
}

// CheckNoWALRelay refuses to poll cfg.Table while a WAL relay streams it:
// while the slot named slot is active, or another pgoutput slot of this
// database whose walsender's command names a publication of the table.
// That command is visible only to the walsender's own role and to
// pg_read_all_stats, so a WAL relay on another slot under another role is
// not seen.
func CheckNoWALRelay(ctx context.Context, conn Querier, cfg Config, slot string) error {
	schema, table, err := SplitTable(cfg.Table)
	if err != nil {
		return err
	}
	var active string
	var pid *int32
	err = conn.QueryRow(ctx, `SELECT s.slot_name::text, s.active_pid FROM pg_replication_slots s
		LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
		WHERE s.database = current_database() AND s.active
		  AND (s.slot_name = $1 OR (s.plugin = 'pgoutput' AND EXISTS (
		      SELECT 1 FROM pg_publication_tables p WHERE p.schemaname = $2 AND p.tablename = $3
		        AND a.query LIKE '%publication_names%' AND position(p.pubname in a.query) > 0)))
		ORDER BY s.slot_name <> $1, s.slot_name LIMIT 1`, slot, schema, table).Scan(&active, &pid)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("look up active replication slots: %w", err)
	}
	walsender := "unknown"
	if pid != nil {
		walsender = fmt.Sprint(*pid)
	}
	return Preconditionf("replication slot %q is active (walsender PID %s): a WAL relay (run --source wal) is streaming %s, and polling it too would publish every event twice; stop that relay first, see %s (or, if that slot is not this table's, give --slot the right name)",
		active, walsender, cfg.Table, modesDoc)
}

// CheckNoPollers refuses to stream cfg.Table while a poller runs on it.
// Pollers run with --poll-session-check=false hold no lock and are not
// seen.
func CheckNoPollers(ctx context.Context, conn Querier, cfg Config) error {
	table, err := cfg.QuotedTable()
	if err != nil {
		return err
	}
	var pids []int32
	err = conn.QueryRow(ctx, `SELECT COALESCE(array_agg(pid ORDER BY pid), '{}') FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND objsubid = 2
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND classid = $1::bigint::oid AND objid = to_regclass($2)::oid`, pollerLockClass, table).Scan(&pids)
	if err != nil {
		return fmt.Errorf("look up pollers of %s: %w", cfg.Table, err)
	}
	if len(pids) == 0 {
		return nil
	}
	return Preconditionf("%d poll-mode relays (run --source poll) are polling %s (their PostgreSQL sessions: PIDs %v), and streaming it too would publish every event twice; stop them first, see %s",
		len(pids), cfg.Table, pids, modesDoc)
}

// snapshotLockClass is the SQL of the first key of the advisory lock the
// active snapshot poller of a table holds (poll's snapshotLock); the
// second is hashtext of the table's quoted name.
const snapshotLockClass = "hashtext('outbox-relay poll snapshot')"

// RunningRelay names every relay that runs now on cfg.Table's schema and
// so reads its partition count registry (shared by the schema's tables),
// none when empty: a session streaming slot, a slot recorded in
// slotRegistry (the schema's slot registry, quoted; skipped when "" or
// missing), or another pgoutput slot whose walsender streams a
// publication of cfg.Table (seen as CheckNoWALRelay sees it); a snapshot
// poller holding its table's lock; a lease poller or a snapshot standby
// holding the shared poller lock on a table of the schema. A one-shot
// command that changes what a running relay has read (partitions adopt)
// refuses while one is.
func RunningRelay(ctx context.Context, conn Querier, cfg Config, slot, slotRegistry string) ([]string, error) {
	schema, table, err := SplitTable(cfg.Table)
	if err != nil {
		return nil, err
	}
	var recorded []string
	if slotRegistry != "" {
		var exists bool
		if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", slotRegistry).Scan(&exists); err != nil {
			return nil, fmt.Errorf("look up the slot registry %s: %w", slotRegistry, err)
		}
		if exists {
			if err := conn.QueryRow(ctx, "SELECT COALESCE(array_agg(slot_name::text), '{}') FROM "+slotRegistry).Scan(&recorded); err != nil {
				return nil, fmt.Errorf("read the slot registry %s: %w", slotRegistry, err)
			}
		}
	}
	var running []string
	err = conn.QueryRow(ctx, `WITH rels AS (
		  SELECT c.oid, format('%I.%I', n.nspname, c.relname) AS name,
		         '"' || replace(n.nspname, '"', '""') || '"."' || replace(c.relname, '"', '""') || '"' AS quoted
		  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		  WHERE n.nspname = $2 AND c.relkind IN ('r', 'p')
		), locks AS (
		  SELECT * FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
		    AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		), snapshot AS (
		  SELECT l.pid, r.name FROM locks l JOIN rels r ON l.objid = hashtext(r.quoted)::oid
		  WHERE l.granted AND l.classid = `+snapshotLockClass+`::oid
		), found AS (
		  SELECT 0 AS ord, 'a relay is streaming replication slot ' || quote_literal(s.slot_name) || ' (walsender PID ' || s.active_pid || ')' AS what
		  FROM pg_replication_slots s
		  WHERE s.database = current_database() AND s.active
		    AND (s.slot_name = $1 OR s.slot_name = ANY($5::text[]) OR (s.plugin = 'pgoutput' AND EXISTS (
		      SELECT 1 FROM pg_stat_activity a JOIN pg_publication_tables p ON position(p.pubname in a.query) > 0
		      WHERE a.pid = s.active_pid AND p.schemaname = $2 AND p.tablename = $3 AND a.query LIKE '%publication_names%')))
		  UNION ALL
		  SELECT 1, 'a snapshot poller is publishing ' || name || ' (PostgreSQL session PID ' || pid || ')' FROM snapshot
		  UNION ALL
		  SELECT 2, 'a poller is polling ' || r.name || ' (the lease strategy, or a snapshot standby waiting to take over; PostgreSQL session PID ' || l.pid || ')'
		  FROM locks l JOIN rels r ON l.objid = r.oid
		  WHERE l.classid = $4::bigint::oid AND NOT EXISTS (SELECT 1 FROM snapshot WHERE snapshot.pid = l.pid)
		)
		SELECT COALESCE(array_agg(what ORDER BY ord, what), '{}') FROM found`,
		slot, schema, table, pollerLockClass, recorded).Scan(&running)
	if err != nil {
		return nil, fmt.Errorf("look up running relays: %w", err)
	}
	return running, nil
}
