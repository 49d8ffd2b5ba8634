package inbox

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Skip reports what SkipMissing did.
type Skip struct {
	// From and Through are the versions recorded as skipped.
	From, Through int64
	// Released counts the parked events applied after them, in order;
	// Version is the aggregate's version afterwards.
	Released int
	Version  int64
}

// SkipMissing is the way out of a version that will never come: it
// records versions of one aggregate, from the one after the last applied
// through through, as skipped (with reason, in the skipped table), and
// then applies the events parked behind them through h, in order, in the
// same transaction, exactly as the missing version's arrival would have.
// Overdue lists the aggregates that wait: for each, Missing.Waiting-1 is
// the through that releases its oldest parked event.
//
// It is safe while consumers run: it takes the aggregate's version lock,
// so a batch of the same aggregate waits for it or it for the batch. It
// refuses, changing nothing, when the versions are applied by then (the
// missing event came after all), when through reaches a parked version
// (that one is not missing), and without a reason. A skipped version that
// arrives later is counted stale and never applied: its effect is lost,
// which is what skipping it means.
func (ib *Inbox) SkipMissing(ctx context.Context, db Beginner, aggregateType, aggregateID string, through int64, reason string, h Handler) (Skip, error) {
	what := fmt.Sprintf("skip %s %s versions through %d", aggregateType, aggregateID, through)
	if strings.TrimSpace(reason) == "" {
		return Skip{}, fmt.Errorf("%s: give a reason (a ticket, who decided); it is kept with the skip", what)
	}
	if h == nil {
		return Skip{}, fmt.Errorf("%s: give the consumer's handler, which applies the events parked behind the skipped versions", what)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return Skip{}, fmt.Errorf("%s: begin: %w", what, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if _, err := tx.Exec(ctx, lockAggregateID, ib.cfg.Consumer, aggregateID); err != nil {
		return Skip{}, fmt.Errorf("%s: lock the aggregate: %w", what, err)
	}
	if aggregateType == "" {
		// A record without a type (CloudEvents, Debezium's shape) uses the
		// versions kept for its id whatever their type; its error names
		// no type, so the skip resolves it the same way.
		var types []string
		rows, err := tx.Query(ctx, `SELECT DISTINCT aggregate_type FROM `+ib.tables.versions()+` WHERE consumer = $1 AND aggregate_id = $2 ORDER BY 1`,
			ib.cfg.Consumer, aggregateID)
		if err == nil {
			types, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
		if err != nil {
			return Skip{}, fmt.Errorf("%s: read the id's versions: %w%s", what, err, missingTableHint(err))
		}
		switch {
		case len(types) > 1:
			return Skip{}, fmt.Errorf("%s: aggregate id %s has versions under the types %q: name the one to skip", what, aggregateID, types)
		case len(types) == 1:
			aggregateType = types[0]
			what = fmt.Sprintf("skip %s %s versions through %d", aggregateType, aggregateID, through)
		}
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+ib.tables.versions()+` (consumer, aggregate_type, aggregate_id, version)
		VALUES ($1, $2, $3, 0) ON CONFLICT DO NOTHING`, ib.cfg.Consumer, aggregateType, aggregateID); err != nil {
		return Skip{}, fmt.Errorf("%s: %w%s", what, err, missingTableHint(err))
	}
	var applied int64
	if err := tx.QueryRow(ctx, `SELECT version FROM `+ib.tables.versions()+`
		WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE`,
		ib.cfg.Consumer, aggregateType, aggregateID).Scan(&applied); err != nil {
		return Skip{}, fmt.Errorf("%s: lock the version: %w", what, err)
	}
	// A statement of its own, after the lock (see lockVersions).
	var lowestParked *int64
	if err := tx.QueryRow(ctx, `SELECT min(version) FROM `+ib.tables.parked()+`
		WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3`,
		ib.cfg.Consumer, aggregateType, aggregateID).Scan(&lowestParked); err != nil {
		return Skip{}, fmt.Errorf("%s: read parked events: %w", what, err)
	}
	switch {
	case through <= applied:
		return Skip{}, fmt.Errorf("%s: version %d is applied already, so nothing before it is missing; list what waits with Overdue", what, applied)
	case lowestParked != nil && through >= *lowestParked:
		return Skip{}, fmt.Errorf("%s: version %d is parked, not missing: skip through %d at most", what, *lowestParked, *lowestParked-1)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+ib.tables.skipped()+` (consumer, aggregate_type, aggregate_id, version, reason, skipped_at)
		SELECT $1, $2, $3, v, $6, $7 FROM generate_series($4::bigint, $5::bigint) AS v`,
		ib.cfg.Consumer, aggregateType, aggregateID, applied+1, through, reason, ib.cfg.Now()); err != nil {
		return Skip{}, fmt.Errorf("%s: record the skip: %w%s", what, err, missingTableHint(err))
	}
	released, last, err := ib.release(ctx, tx, aggregate{aggregateType, aggregateID}, through, "(skip)", h)
	if err != nil {
		var he *handlerError
		if errors.As(err, &he) {
			ib.m.handlerErrors.Add(1)
		}
		return Skip{}, fmt.Errorf("%s: apply the parked events: %w (nothing was skipped)", what, err)
	}
	if _, err := tx.Exec(ctx, `UPDATE `+ib.tables.versions()+` SET version = $4
		WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3`,
		ib.cfg.Consumer, aggregateType, aggregateID, last); err != nil {
		return Skip{}, fmt.Errorf("%s: store the version: %w", what, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return Skip{}, fmt.Errorf("%s: commit: %w", what, err)
	}
	ib.m.skipped.Add(through - applied)
	ib.m.applied.Add(int64(released))
	return Skip{From: applied + 1, Through: through, Released: released, Version: last}, nil
}
