package replication

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
)

// CheckRetention verifies what deleting published rows needs, before the
// relay starts: the column that dates a row (a Debezium table has no
// "timestamp" column unless one was added, and --column-created-at names
// another) with a time type, and SELECT and DELETE on the table. Without
// the column the cleanup would fail at every interval behind a ready
// relay.
func (a *Admin) CheckRetention(ctx context.Context) error {
	schema, table, err := pg.SplitTable(a.cfg.Table)
	if err != nil {
		return err
	}
	quoted := pg.QuoteIdent(schema) + "." + pg.QuoteIdent(table)
	l := a.cfg.OutboxLayout()
	col := l.Column(layout.CreatedAt)
	var typ string
	err = a.conn.QueryRow(ctx, `
		SELECT format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END, NULL)
		FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
		WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped`, quoted, col).Scan(&typ)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: %w: --retention deletes rows by the time they were inserted, but the outbox table %s.%s has no column %s: name the table's insert-time column with --column-created-at, add one (ALTER TABLE %s ADD COLUMN %s timestamptz NOT NULL DEFAULT now()), or leave --retention unset",
			pg.ErrPrecondition, layout.ErrColumnMapping, schema, table, pg.QuoteIdent(col), quoted, pg.QuoteIdent(col))
	}
	if err != nil {
		return fmt.Errorf("read column %s of %s: %w", col, quoted, err)
	}
	if typ != "timestamp with time zone" && typ != "timestamp without time zone" {
		return fmt.Errorf("%w: %w: --retention dates rows by column %s of %s, which is %s, not a timestamp: name the insert-time column with --column-created-at, or leave --retention unset",
			pg.ErrPrecondition, layout.ErrColumnMapping, pg.QuoteIdent(col), quoted, typ)
	}
	return pg.RequireTablePrivileges(ctx, a.conn, quoted, []string{"SELECT", "DELETE"}, "--retention")
}
