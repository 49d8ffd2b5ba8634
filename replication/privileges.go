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
