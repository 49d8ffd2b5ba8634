package relay

import (
	"context"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/store"
)

// Permanent-error policies, chosen by --on-permanent-error.
const (
	OnPermanentQuarantine = "quarantine"
	OnPermanentHalt       = "halt"
)

// Quarantined is one event Kafka would not accept; the store keeps it.
type Quarantined = store.Quarantined

// eventOfQuarantined turns a quarantined row back into an event to publish
// again. The quarantine table cannot hold a NULL, so a value the row lacked
// comes back empty; replay's row check refuses it like the read loop's.
func eventOfQuarantined(e *Quarantined) *publisher.Event {
	ev := &publisher.Event{
		EventID: []byte(e.EventID), AggregateType: []byte(e.AggregateType), AggregateID: []byte(e.AggregateID),
		EventType: []byte(e.EventType), SchemaVersion: []byte(e.SchemaVersion), Payload: []byte(e.Payload),
		OccurredAt: []byte(e.OccurredAt),
	}
	if e.Headers != "" {
		ev.Headers = []byte(e.Headers)
	}
	return ev
}

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
	return store.OpenQuarantine(ctx, r.cfg.Replication, table, access)
}
