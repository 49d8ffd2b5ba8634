package relay

import (
	"context"
	"encoding/json"

	"github.com/outbox-relay/outbox-relay/layout"
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
// again, in the layout's shape. The quarantine table cannot hold a NULL
// (but for the payload of Debezium's layout), so a value the row lacked
// comes back empty; replay's row check refuses it like the read loop's.
func eventOfQuarantined(e *Quarantined, l *layout.Layout) *publisher.Event {
	ev := &publisher.Event{
		EventID: []byte(e.EventID), AggregateType: []byte(e.AggregateType), AggregateID: []byte(e.AggregateID),
		EventType: []byte(e.EventType), SchemaVersion: []byte(e.SchemaVersion), Payload: []byte(e.Payload),
		OccurredAt: []byte(e.OccurredAt), Layout: l,
	}
	if e.Headers != "" {
		ev.Headers = []byte(e.Headers)
	}
	if l.Shape == layout.ShapeDebezium {
		if e.PayloadNull {
			ev.Payload = nil
		}
		ev.Extra, ev.Headers = splitDebeziumHeaders(e.Headers, l)
	}
	return ev
}

// splitDebeziumHeaders undoes debeziumHeaders: the header columns' values
// in layout order (null or absent as nil), and the other members as the
// row's headers.
func splitDebeziumHeaders(stored string, l *layout.Layout) (extra [][]byte, rest []byte) {
	members := map[string]json.RawMessage{}
	if stored != "" {
		if err := json.Unmarshal([]byte(stored), &members); err != nil {
			// Not written by the relay: replay it as the row's headers and
			// let the record builder say what is wrong.
			return make([][]byte, len(l.HeaderColumns)), []byte(stored)
		}
	}
	extra = make([][]byte, len(l.HeaderColumns))
	for i, name := range l.HeaderNames() {
		raw, ok := members[name]
		delete(members, name)
		if !ok || string(raw) == "null" {
			continue
		}
		var s string
		if json.Unmarshal(raw, &s) == nil {
			extra[i] = []byte(s)
		} else {
			extra[i] = raw
		}
	}
	if len(members) > 0 {
		rest, _ = json.Marshal(members)
	}
	return extra, rest
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
	return store.OpenQuarantine(ctx, r.cfg.Replication.Config, table, access)
}
