package relay

import (
	"context"

	"github.com/outbox-relay/outbox-relay/store"
)

// Quarantined is one event Kafka would not accept; the store keeps it.
type Quarantined = store.Quarantined

// quarantineTable is the table quarantined events go to.
func (c Config) quarantineTable() (store.Table, error) {
	return store.QuarantineTable(c.Replication.Table, c.QuarantineTable)
}

// openQuarantine opens the quarantine table for access.
func (r *Relay) openQuarantine(ctx context.Context, access store.Access) (*store.Quarantine, error) {
	table, err := r.cfg.quarantineTable()
	if err != nil {
		return nil, err
	}
	return store.OpenQuarantine(ctx, r.cfg.Replication.Config, table, access)
}
