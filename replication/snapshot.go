package replication

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pg"
)

// SlotSnapshot is the slot just created together with the snapshot of its
// consistent point: a transaction that imports Snapshot sees exactly the
// transactions committed before LSN, and the slot streams exactly those
// committed after it. Between them nothing is missed and nothing is seen
// twice, which is what recovering a lost slot from the table needs.
type SlotSnapshot struct {
	LSN lsn.LSN
	// Snapshot is the name SET TRANSACTION SNAPSHOT takes. It stays
	// importable only while the connection that made it is open and runs
	// nothing else: Close it once the importing transaction has begun.
	Snapshot string
	// Before is the server's clock just before the slot was made: every
	// transaction the snapshot sees committed before it.
	Before time.Time

	conn *pgconn.PgConn
}

// Close ends the connection that made the slot; the slot stays, the
// snapshot goes with the connection.
func (s *SlotSnapshot) Close() {
	if s.conn != nil {
		s.conn.Close(context.Background())
		s.conn = nil
	}
}

// LockRecovery takes the lock that lets one relay at a time recover the
// slot; ok is false when another session holds it. The lock is the
// admin connection's and goes when it closes: two relays of one slot that
// found it lost at once must not drop each other's new slot.
func (a *Admin) LockRecovery(ctx context.Context) (ok bool, err error) {
	err = a.conn.QueryRow(ctx, "SELECT pg_try_advisory_lock(hashtext('outbox-relay slot recovery'), hashtext($1))", a.cfg.Slot).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("take the lock of the slot's recovery: %w", err)
	}
	return ok, nil
}

// CreateSlotWithSnapshot creates the permanent pgoutput slot, as CreateSlot
// does, on a replication connection that exports the snapshot of the
// slot's consistent point. The caller must Close the result.
func (a *Admin) CreateSlotWithSnapshot(ctx context.Context) (*SlotSnapshot, error) {
	options := "SNAPSHOT 'export'"
	if a.cfg.SlotFailover {
		if err := a.requireFailoverSupport(ctx); err != nil {
			return nil, err
		}
		options += ", FAILOVER true"
	}
	var before time.Time
	if err := a.conn.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&before); err != nil {
		return nil, fmt.Errorf("read the server's clock: %w", err)
	}
	conn, err := pg.DialReplication(ctx, a.cfg.Config, nil)
	if err != nil {
		return nil, err
	}
	res, err := pglogrepl.ParseCreateReplicationSlot(conn.Exec(ctx,
		fmt.Sprintf("CREATE_REPLICATION_SLOT %s LOGICAL pgoutput (%s)", pg.QuoteIdent(a.cfg.Slot), options)))
	if err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("create slot %s with its snapshot: %w (check max_replication_slots and the role's REPLICATION attribute)", a.cfg.Slot, err)
	}
	at, err := lsn.Parse(res.ConsistentPoint)
	if err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("create slot %s: %w", a.cfg.Slot, err)
	}
	return &SlotSnapshot{LSN: at, Snapshot: res.SnapshotName, Before: before, conn: conn}, nil
}
