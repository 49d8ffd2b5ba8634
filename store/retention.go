package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/layout"
)

// CountCreatedBefore counts the outbox rows created (by the layout's
// insert-time column) before cutoff: what a
// cleanup would delete, for a dry run.
func CountCreatedBefore(ctx context.Context, conn *pgx.Conn, outbox Table, l *layout.Layout, cutoff time.Time) (int64, error) {
	var n int64
	created := pgx.Identifier{l.Column(layout.CreatedAt)}.Sanitize()
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM "+outbox.Quoted()+" WHERE "+created+" < $1", cutoff).Scan(&n); err != nil {
		return 0, fmt.Errorf("count published rows: %w", err)
	}
	return n, nil
}

// DeleteCreatedBefore deletes the outbox rows created before cutoff, batch
// rows per transaction so no lock is held long, until none are left or ctx
// ends. deleted is told each batch's count as it commits.
func DeleteCreatedBefore(ctx context.Context, conn *pgx.Conn, outbox Table, l *layout.Layout, cutoff time.Time, batch int, deleted func(int64)) (int64, error) {
	quoted := outbox.Quoted()
	id, created := pgx.Identifier{l.Column(layout.EventID)}.Sanitize(), pgx.Identifier{l.Column(layout.CreatedAt)}.Sanitize()
	query := fmt.Sprintf(`DELETE FROM %[1]s WHERE %[2]s IN (SELECT %[2]s FROM %[1]s WHERE %[3]s < $1 LIMIT %[4]d)`, quoted, id, created, batch)
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
