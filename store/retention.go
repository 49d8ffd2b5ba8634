package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/layout"
)

// Retention is when published outbox rows are deleted, the one rule of
// every table source: a row goes once it is published and was inserted
// (the layout's insert-time column) longer ago than After.
type Retention struct {
	// After is how old a row must be before it may go; zero turns cleanup
	// off.
	After    time.Duration
	Interval time.Duration // how often cleanup runs
	Batch    int           // rows deleted per transaction
	DryRun   bool          // count what would go, delete nothing
}

// DefaultRetention is cleanup off, with the interval and batch it uses
// when turned on.
func DefaultRetention() Retention { return Retention{Interval: time.Minute, Batch: 1000} }

// Validate names the flag of a setting that cannot work.
func (r Retention) Validate() error {
	switch {
	case r.After < 0:
		return fmt.Errorf("--retention %s: must not be negative", r.After)
	case r.After > 0 && r.Interval <= 0:
		return fmt.Errorf("--retention-interval %s: must be positive", r.Interval)
	case r.After > 0 && r.Batch < 1:
		return fmt.Errorf("--retention-batch %d: must be at least 1", r.Batch)
	}
	return nil
}

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
