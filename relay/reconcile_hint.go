package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/replication"
)

// reconcileCommand is the `outbox-relay reconcile` command that finds the
// events a slot created just now will never deliver: the rows from the
// table's oldest to the slot's creation. Rows committed before the slot
// existed reach Kafka only that way. Empty when the table is empty.
func reconcileCommand(ctx context.Context, admin *replication.Admin, table string) (string, error) {
	schema, name, err := replication.SplitTable(table)
	if err != nil {
		return "", err
	}
	var oldest *time.Time
	var now time.Time
	err = admin.Conn().QueryRow(ctx, "SELECT min(created_at), now() FROM "+pgx.Identifier{schema, name}.Sanitize()).Scan(&oldest, &now)
	if err != nil {
		return "", fmt.Errorf("read the oldest row of %s: %w", table, err)
	}
	if oldest == nil {
		return "", nil
	}
	return fmt.Sprintf("outbox-relay reconcile --since %s --until %s (with run's connection flags; add --republish to send what it finds)",
		oldest.UTC().Truncate(time.Second).Format(time.RFC3339), now.UTC().Add(time.Second).Truncate(time.Second).Format(time.RFC3339)), nil
}
