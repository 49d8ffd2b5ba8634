package main

import (
	"context"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
)

// statusReport is what `status` prints: the slot's row, the delivery mode
// (--delivery, as in the config file run uses), and with --kafka-brokers
// the progress kept in Kafka: in exactly-once mode, the last committed
// progress.
type statusReport struct {
	*replication.SlotInfo
	Delivery string `json:"delivery"`
	// FailoverWarning says why the slot would not survive a failover.
	FailoverWarning string                `json:"failover_warning,omitempty"`
	Progress        *relay.ProgressReport `json:"progress,omitempty"`
}

// progressReport reads the progress record and where a relay starting now
// would start; it creates nothing.
func progressReport(ctx context.Context, cfg relay.Config, slot *replication.SlotInfo) (*relay.ProgressReport, error) {
	confirmed, err := slot.Confirmed()
	if err != nil {
		return nil, err
	}
	return relay.ReadProgress(ctx, cfg, confirmed)
}
