package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// CountCreatedBefore counts the outbox rows created before cutoff: what a
// cleanup would delete, for a dry run.
func CountCreatedBefore(ctx context.Context, conn *pgx.Conn, outbox Table, cutoff time.Time) (int64, error) {
	var n int64
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM "+outbox.Quoted()+" WHERE created_at < $1", cutoff).Scan(&n); err != nil {
		return 0, fmt.Errorf("count published rows: %w", err)
	}
	return n, nil
}

// DeleteCreatedBefore deletes the outbox rows created before cutoff, batch
// rows per transaction so no lock is held long, until none are left or ctx
// ends. deleted is told each batch's count as it commits.
func DeleteCreatedBefore(ctx context.Context, conn *pgx.Conn, outbox Table, cutoff time.Time, batch int, deleted func(int64)) (int64, error) {
	quoted := outbox.Quoted()
	query := fmt.Sprintf(`DELETE FROM %s WHERE event_id IN (SELECT event_id FROM %s WHERE created_at < $1 LIMIT %d)`, quoted, quoted, batch)
	var total int64
	for ctx.Err() == nil {
		tag, err := conn.Exec(ctx, query, cutoff)
		if err != nil {
			return total, fmt.Errorf("delete published rows: %w", err)
		}
		n := tag.RowsAffected()
		total += n
		deleted(n)
		if n < int64(batch) {
			break
		}
	}
	return total, nil
}
