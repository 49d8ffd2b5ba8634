package replication

import (
	"context"

	"github.com/outbox-relay/outbox-relay/pg"
)

// CheckRetention verifies what deleting published rows needs, before the
// relay starts (pg.CheckRetention).
func (a *Admin) CheckRetention(ctx context.Context) error {
	return pg.CheckRetention(ctx, a.conn, a.cfg.Config)
}

// CheckRepublish verifies what republishing from the table needs, before
// the relay starts with --on-slot-lost recover or --existing-rows pending:
// the column that dates a row, which selects a recovery's window, and
// SELECT on the table.
func (a *Admin) CheckRepublish(ctx context.Context) error {
	if err := pg.CheckCreatedAt(ctx, a.conn, a.cfg.Config, "--on-slot-lost recover and --existing-rows pending select the rows to republish by the time they were inserted",
		"or use --on-slot-lost stop and --existing-rows refuse or published"); err != nil {
		return err
	}
	return pg.RequireTablePrivileges(ctx, a.conn, pg.QuotedTable(a.cfg.Table), []string{"SELECT"}, "republishing from the table (--on-slot-lost recover, --existing-rows pending)")
}
