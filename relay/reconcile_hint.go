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
// existed reach Kafka only that way. Empty when the table is empty; when
// the relay's role may not read the table, the start is left for the
// operator to fill in.
func reconcileCommand(ctx context.Context, admin *replication.Admin, table string) string {
	const advice = "add --republish to send what it finds"
	schema, name, err := replication.SplitTable(table)
	if err != nil {
		return ""
	}
	var oldest *time.Time
	now := time.Now()
	err = admin.Conn().QueryRow(ctx, "SELECT min(created_at), now() FROM "+pgx.Identifier{schema, name}.Sanitize()).Scan(&oldest, &now)
	until := now.UTC().Add(time.Second).Truncate(time.Second).Format(time.RFC3339)
	switch {
	case err != nil:
		return fmt.Sprintf("outbox-relay reconcile --since <the oldest created_at that may be missing> --until %s (as a role that may read %s; %s)",
			until, table, advice)
	case oldest == nil:
		return ""
	}
	return fmt.Sprintf("outbox-relay reconcile --since %s --until %s (with run's connection flags; %s)",
		oldest.UTC().Truncate(time.Second).Format(time.RFC3339), until, advice)
}
