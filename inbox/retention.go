package inbox

import (
	"context"
	"fmt"
	"time"
)

// Overdue lists the aggregates whose oldest parked event has waited longer
// than MissingAfter for its predecessor, and sets the
// inbox_missing_predecessors gauge to their number. Call it periodically
// (an alert on the gauge then catches a predecessor that never comes).
func (ib *Inbox) Overdue(ctx context.Context, db Querier) ([]Missing, error) {
	rows, err := db.Query(ctx, `SELECT p.aggregate_type, p.aggregate_id, COALESCE(v.version, 0), min(p.version), min(p.parked_at)
		FROM `+ib.tables.parked()+` p LEFT JOIN `+ib.tables.versions()+` v
		  ON v.consumer = p.consumer AND v.aggregate_type = p.aggregate_type AND v.aggregate_id = p.aggregate_id
		WHERE p.consumer = $1
		GROUP BY p.aggregate_type, p.aggregate_id, v.version
		HAVING min(p.parked_at) <= $2
		ORDER BY min(p.parked_at)`, ib.cfg.Consumer, ib.cfg.Now().Add(-ib.cfg.MissingAfter))
	if err != nil {
		return nil, fmt.Errorf("list missing predecessors: %w", err)
	}
	defer rows.Close()
	var out []Missing
	for rows.Next() {
		var m Missing
		if err := rows.Scan(&m.AggregateType, &m.AggregateID, &m.Applied, &m.Waiting, &m.Since); err != nil {
			return nil, fmt.Errorf("list missing predecessors: %w", err)
		}
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list missing predecessors: %w", err)
	}
	ib.m.missing.Store(int64(len(out)))
	return out, nil
}

// pruneBatch bounds each DELETE, so pruning a large backlog never holds
// many row locks or one long transaction.
const pruneBatch = 10_000

// Prune deletes this consumer's processed-event records older than
// olderThan and returns how many it deleted.
//
// A record must outlive every re-delivery of its event: once it is gone,
// the same event_id is applied again. Events come back from Kafka for as
// long as the topic keeps them (retention.ms), and later too when someone
// replays: a consumer group reset to an old offset, a quarantined event
// replayed, `outbox-relay reconcile --republish` over an old window. So
// Prune refuses an age below Config.RetentionFloor, which you set to the
// topics' retention plus the longest replay you expect, and refuses to run
// when the floor is not set.
func (ib *Inbox) Prune(ctx context.Context, db Querier, olderThan time.Duration) (int64, error) {
	if ib.cfg.RetentionFloor <= 0 {
		return 0, fmt.Errorf("prune %s: Config.RetentionFloor is not set; set it to the topics' retention plus the longest replay you expect", ib.cfg.Consumer)
	}
	if olderThan < ib.cfg.RetentionFloor {
		return 0, fmt.Errorf("prune %s: age %v is below the retention floor %v; records younger than the longest possible re-delivery would let a re-delivered event apply twice",
			ib.cfg.Consumer, olderThan, ib.cfg.RetentionFloor)
	}
	cutoff := ib.cfg.Now().Add(-olderThan)
	var total int64
	for {
		tag, err := db.Exec(ctx, `DELETE FROM `+ib.tables.processed()+` WHERE ctid = ANY (ARRAY(
			SELECT ctid FROM `+ib.tables.processed()+` WHERE consumer = $1 AND processed_at < $2 LIMIT $3))`,
			ib.cfg.Consumer, cutoff, pruneBatch)
		if err != nil {
			return total, fmt.Errorf("prune %s: %w", ib.cfg.Consumer, err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < pruneBatch {
			return total, nil
		}
	}
}
