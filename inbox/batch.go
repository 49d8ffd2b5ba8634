package inbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// HandleBatch applies events, a run of records of one partition in their
// order, in one transaction: one multi-row insert records the event_ids and
// returns the new ones, one query reads and locks the versions of every
// aggregate in the batch, h runs for each new event in order, parked
// successors are released, and one commit ends it. That is a handful of
// round trips per batch instead of several per event.
//
// On success it returns one Result per event. On error it returns the
// results of the events before the failing one, all committed, and the
// error of the first event that could not be applied; nothing after it was
// applied. So a consumer marks the offsets of the returned results and
// handles the rest again. A failing event is isolated by handling the batch
// again one event per transaction, so a handler error in the middle of a
// batch neither loses the events before it nor applies anything twice.
func (ib *Inbox) HandleBatch(ctx context.Context, db Beginner, events []Event, h Handler) ([]Result, error) {
	valid := len(events)
	for i := range events {
		if events[i].ID == "" {
			valid = i
			break
		}
	}
	spans := ib.startSpans(ctx, events[:valid])
	results, err := ib.handleValid(ctx, db, events[:valid], h, spans)
	if err == nil && valid < len(events) {
		err = ErrNoEventID
	}
	endSpans(spans, results, err)
	return results, err
}

func (ib *Inbox) handleValid(ctx context.Context, db Beginner, events []Event, h Handler, spans []eventSpan) ([]Result, error) {
	if len(events) == 0 {
		return nil, nil
	}
	if len(events) > 1 {
		results, reports, err := ib.applyInTx(ctx, db, events, h, spans)
		if err == nil {
			ib.count(events, results, reports)
			return results, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		if endedBySQL(err) {
			// What the handler's COMMIT took with it is settled (see
			// settleEndedTx); the events after it come again.
			ib.countFailure(err)
			return nil, err
		}
	}
	results := make([]Result, 0, len(events))
	for i := range events {
		var one []eventSpan
		if spans != nil {
			one = spans[i : i+1]
		}
		res, reports, err := ib.applyInTx(ctx, db, events[i:i+1], h, one)
		if err != nil {
			ib.countFailure(err)
			return results, err
		}
		ib.count(events[i:i+1], res, reports)
		results = append(results, res[0])
	}
	return results, nil
}

func (ib *Inbox) count(events []Event, results []Result, reports []Missing) {
	now := ib.cfg.Now()
	for i, r := range results {
		switch r.Outcome {
		case Applied:
			ib.m.applied.Add(int64(1 + r.Released))
			if at := occurredAt(&events[i]); !at.IsZero() {
				ib.m.occurredToApplied.Observe(now.Sub(at).Seconds())
			}
		case Duplicate:
			ib.m.duplicates.Add(1)
		case Stale:
			ib.m.staleVersions.Add(1)
		case Parked:
			ib.m.gaps.Add(1)
		}
	}
	for _, m := range reports {
		ib.m.missingReports.Add(1)
		if ib.cfg.OnMissingPredecessor != nil {
			ib.cfg.OnMissingPredecessor(m)
		}
	}
}

func (ib *Inbox) countFailure(err error) {
	var he *handlerError
	switch {
	case errors.As(err, &he):
		ib.m.handlerErrors.Add(1)
	case errors.Is(err, ErrVersionGap):
		ib.m.gaps.Add(1)
	}
}

// aggregate names one aggregate.
type aggregate struct{ typ, id string }

// applyInTx applies events in one transaction begun on db and commits it.
// It returns the missing-predecessor reports to make once committed.
func (ib *Inbox) applyInTx(ctx context.Context, db Beginner, events []Event, h Handler, spans []eventSpan) ([]Result, []Missing, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("event %s: begin: %w", events[0].ID, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	fresh, err := ib.record(ctx, tx, events)
	if err != nil {
		return nil, nil, err
	}
	results := make([]Result, len(events))
	var v *versionState
	if ib.cfg.CheckVersions {
		if v, err = ib.lockVersions(ctx, tx, events, fresh); err != nil {
			return nil, nil, err
		}
	}
	var reports []Missing
	wrote := false
	for i, ev := range events {
		if !fresh[i] {
			results[i] = Result{Outcome: Duplicate}
			continue
		}
		wrote = true
		if v == nil || ev.Version == 0 {
			if err := ib.run(ctxOf(ctx, spans, i), tx, ev, h); err != nil {
				return nil, nil, ib.settleEndedTx(ctx, db, events, fresh, i, v, err)
			}
			results[i] = Result{Outcome: Applied}
			continue
		}
		res, missing, err := ib.applyVersioned(ctxOf(ctx, spans, i), tx, v, ev, h)
		if err != nil {
			return nil, nil, ib.settleEndedTx(ctx, db, events, fresh, i, v, err)
		}
		results[i] = res
		if missing != nil {
			reports = append(reports, *missing)
		}
	}
	if !wrote {
		// Only duplicates: nothing was written, so there is nothing to commit.
		return results, nil, nil
	}
	if v != nil {
		if err := ib.storeVersions(ctx, tx, v); err != nil {
			return nil, nil, fmt.Errorf("event %s: %w", events[0].ID, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, nil, fmt.Errorf("event %s: commit: %w", events[0].ID, err)
	}
	return results, reports, nil
}

// settleEndedTx returns err, the error of event i's handler, after setting
// right what a COMMIT that handler sent as SQL took with it: the records
// of the batch's later events, whose handlers never ran (they are
// deleted, so those events come again), and the versions applied up to
// and including event i (stored, so the next versions apply). A ROLLBACK
// took everything back, and an error of any other kind left nothing
// committed: then there is nothing to settle.
func (ib *Inbox) settleEndedTx(ctx context.Context, db Beginner, events []Event, fresh []bool, i int, v *versionState, err error) error {
	if !endedBySQL(err) {
		return err
	}
	fail := func(what string, cause error) error {
		return fmt.Errorf("%w; then %s: %w (the records of events after %s may be committed without their effects: "+
			"delete them from %s for consumer %s)", err, what, cause, events[i].ID, ib.tables.processed(), ib.cfg.Consumer)
	}
	tx, berr := db.Begin(ctx)
	if berr != nil {
		return fail("begin", berr)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	var committed bool
	if qerr := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+ib.tables.processed()+` WHERE consumer = $1 AND event_id = $2)`,
		ib.cfg.Consumer, events[i].ID).Scan(&committed); qerr != nil {
		return fail("look for its record", qerr)
	}
	if !committed {
		return err
	}
	var later []string
	for j := i + 1; j < len(events); j++ {
		if fresh[j] {
			later = append(later, events[j].ID)
		}
	}
	if _, xerr := tx.Exec(ctx, `DELETE FROM `+ib.tables.processed()+` WHERE consumer = $1 AND event_id = ANY($2)`,
		ib.cfg.Consumer, later); xerr != nil {
		return fail("take back the later events' records", xerr)
	}
	if v != nil {
		if serr := ib.storeVersions(ctx, tx, v); serr != nil {
			return fail("store the versions it applied", serr)
		}
	}
	if cerr := tx.Commit(ctx); cerr != nil {
		return fail("commit", cerr)
	}
	return err
}

// record inserts the processed-event records of events in one statement
// and reports which events are new: an event_id recorded before, or earlier
// in the same batch, is a duplicate. The ids go in sorted order so that two
// consumers recording overlapping batches (a rebalance) lock rows in the
// same order instead of deadlocking.
func (ib *Inbox) record(ctx context.Context, tx pgx.Tx, events []Event) ([]bool, error) {
	ids := make([]string, len(events))
	for i := range events {
		ids[i] = events[i].ID
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	rows, err := tx.Query(ctx, `INSERT INTO `+ib.tables.processed()+` (consumer, event_id)
		SELECT $1, id FROM unnest($2::text[]) AS u(id) ORDER BY id
		ON CONFLICT DO NOTHING RETURNING event_id`, ib.cfg.Consumer, ids)
	if err != nil {
		return nil, fmt.Errorf("event %s: record: %w", events[0].ID, err)
	}
	inserted := make(map[string]bool, len(ids))
	var id string
	_, err = pgx.ForEachRow(rows, []any{&id}, func() error {
		inserted[id] = true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("event %s: record: %w", events[0].ID, err)
	}
	fresh := make([]bool, len(events))
	for i := range events {
		// The first occurrence takes the record; later ones are duplicates.
		fresh[i] = inserted[events[i].ID]
		delete(inserted, events[i].ID)
	}
	return fresh, nil
}

// versionState is what a batch knows of its aggregates' versions.
type versionState struct {
	applied map[aggregate]int64
	// parked: the aggregate has events parked, so applying one of its
	// versions must look for successors to release.
	parked map[aggregate]bool
	// changed: the aggregates whose applied version the batch moved.
	changed map[aggregate]bool
	// untyped: the aggregate whose versions an event without an
	// aggregate type uses, by its id.
	untyped map[string]aggregate
}

// keyOf is the aggregate whose versions ev uses.
func (v *versionState) keyOf(ev Event) aggregate {
	if ev.AggregateType == "" {
		if a, ok := v.untyped[ev.AggregateID]; ok {
			return a
		}
	}
	return aggregate{ev.AggregateType, ev.AggregateID}
}

// lockVersions reads the applied version of every aggregate the batch's new
// versioned events belong to (0 for a new one) and locks their rows, in a
// fixed order, so two consumers handling the same aggregate at once (a
// rebalance) take turns; and it notes which of them have parked events.
//
// The versions of an aggregate are kept under its type and id, and a
// record that carries no aggregate type (CloudEvents, Debezium's shape)
// must find the same row as the relay's format did, or a switch of
// --record-format would park every aggregate's next event for ever. So an
// event without a type takes the row of its id whatever the type (there
// must be one type per id: two are refused as ambiguous), and gets a row
// under the empty type only when its id has none; an event with a type
// whose row is missing takes over the empty type's row of its id, with its
// parked events, so switching back is seamless too.
//
// It sends a few statements per aggregate, pipelined in one round trip,
// rather than one statement over arrays: each is an index lookup
// whatever the table's statistics say, while a join against an unnested
// array was planned as a scan of all the consumer's versions when the
// statistics were older than the table (a new consumer draining a backlog).
// lockAggregateID takes, until the transaction ends, the lock under which
// an aggregate id's version rows are made, whatever their type.
const lockAggregateID = `SELECT pg_advisory_xact_lock(hashtext('outbox-relay inbox ' || $1), hashtext($2))`

func (ib *Inbox) lockVersions(ctx context.Context, tx pgx.Tx, events []Event, fresh []bool) (*versionState, error) {
	v := &versionState{applied: map[aggregate]int64{}, parked: map[aggregate]bool{}, changed: map[aggregate]bool{}, untyped: map[string]aggregate{}}
	var typed []aggregate
	var untyped []string
	seen := map[aggregate]bool{}
	for i, ev := range events {
		a := aggregate{ev.AggregateType, ev.AggregateID}
		if seen[a] || !fresh[i] || ev.Version == 0 {
			continue
		}
		seen[a] = true
		if a.typ == "" {
			untyped = append(untyped, a.id)
		} else {
			typed = append(typed, a)
		}
	}
	if len(typed) == 0 && len(untyped) == 0 {
		return v, nil
	}
	slices.SortFunc(typed, func(x, y aggregate) int {
		if c := strings.Compare(x.typ, y.typ); c != 0 {
			return c
		}
		return strings.Compare(x.id, y.id)
	})
	slices.Sort(untyped)
	// A typed aggregate's row, created if missing: from the empty type's
	// row of its id, if there is one, which it replaces (it says so, and
	// its parked events follow it below), else at version 0.
	insertTyped := `WITH untyped AS (
			DELETE FROM ` + ib.tables.versions() + ` WHERE consumer = $1 AND aggregate_type = '' AND aggregate_id = $3
			AND NOT EXISTS (SELECT 1 FROM ` + ib.tables.versions() + ` WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3)
			RETURNING version
		)
		INSERT INTO ` + ib.tables.versions() + ` (consumer, aggregate_type, aggregate_id, version)
		SELECT $1, $2, $3, COALESCE((SELECT version FROM untyped), 0) ON CONFLICT DO NOTHING
		RETURNING EXISTS (SELECT 1 FROM untyped)`
	lockTyped := `SELECT version FROM ` + ib.tables.versions() + `
		WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE`
	// Its own statement, after the lock: under READ COMMITTED a statement
	// that waited for the lock re-reads the locked row, but the rest of it
	// keeps the snapshot from before the wait, and would miss an event the
	// lock's holder parked. (Under REPEATABLE READ the snapshot is the
	// transaction's; there, park writes the version row, so a waiter fails
	// with a serialization error and its retry sees the parked event.)
	parkedTyped := `SELECT EXISTS (SELECT 1 FROM ` + ib.tables.parked() + `
		WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3)`
	// An untyped aggregate's row: any of its id, or one under the empty
	// type when its id has none.
	insertUntyped := `INSERT INTO ` + ib.tables.versions() + ` (consumer, aggregate_type, aggregate_id, version)
		SELECT $1, '', $2, 0 WHERE NOT EXISTS (SELECT 1 FROM ` + ib.tables.versions() + ` WHERE consumer = $1 AND aggregate_id = $2)
		ON CONFLICT DO NOTHING`
	lockUntyped := `SELECT aggregate_type, version FROM ` + ib.tables.versions() + `
		WHERE consumer = $1 AND aggregate_id = $2 ORDER BY aggregate_type FOR UPDATE`
	parkedUntyped := `SELECT DISTINCT aggregate_type FROM ` + ib.tables.parked() + ` WHERE consumer = $1 AND aggregate_id = $2`

	batch := &pgx.Batch{}
	// One aggregate id's rows are made under one lock, whatever the type:
	// a typed and an untyped batch of a new aggregate would otherwise each
	// miss the other's uncommitted row and make two, and their versions
	// would park behind each other for ever. Taken in id order, before any
	// row lock, so two batches never wait on each other in a circle.
	var ids []string
	for _, a := range typed {
		ids = append(ids, a.id)
	}
	ids = append(ids, untyped...)
	slices.Sort(ids)
	for _, id := range slices.Compact(ids) {
		batch.Queue(lockAggregateID, ib.cfg.Consumer, id)
	}
	var tookOver []aggregate
	for _, a := range typed {
		batch.Queue(insertTyped, ib.cfg.Consumer, a.typ, a.id).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var took bool
				if err := rows.Scan(&took); err != nil {
					return err
				}
				if took {
					tookOver = append(tookOver, a)
				}
			}
			return rows.Err()
		})
		batch.Queue(lockTyped, ib.cfg.Consumer, a.typ, a.id).QueryRow(func(row pgx.Row) error {
			var version int64
			if err := row.Scan(&version); err != nil {
				return err
			}
			v.applied[a] = version
			return nil
		})
		batch.Queue(parkedTyped, ib.cfg.Consumer, a.typ, a.id).QueryRow(func(row pgx.Row) error {
			var p bool
			if err := row.Scan(&p); err != nil {
				return err
			}
			v.parked[a] = p
			return nil
		})
	}
	var ambiguous error
	for _, id := range untyped {
		batch.Queue(insertUntyped, ib.cfg.Consumer, id)
		batch.Queue(lockUntyped, ib.cfg.Consumer, id).Query(func(rows pgx.Rows) error {
			var types []string
			var versions []int64
			for rows.Next() {
				var typ string
				var version int64
				if err := rows.Scan(&typ, &version); err != nil {
					return err
				}
				types, versions = append(types, typ), append(versions, version)
			}
			if err := rows.Err(); err != nil {
				return err
			}
			// The empty type sorts first; a typed row wins over it.
			k := len(types) - 1
			switch {
			case k < 0:
				return fmt.Errorf("no version row for aggregate id %q", id)
			case k >= 2 || (k == 1 && types[0] != ""):
				if ambiguous == nil {
					ambiguous = fmt.Errorf("aggregate id %q has versions under the aggregate types %q: a record without an aggregate type "+
						"(CloudEvents, Debezium's shape) cannot tell which it belongs to; keep aggregate ids unique across aggregate types, "+
						"or turn CheckVersions off for this consumer", id, types)
				}
				return nil
			}
			a := aggregate{types[k], id}
			v.untyped[id] = a
			if _, typedToo := v.applied[a]; !typedToo {
				v.applied[a] = versions[k]
			}
			return nil
		})
		batch.Queue(parkedUntyped, ib.cfg.Consumer, id).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var typ string
				if err := rows.Scan(&typ); err != nil {
					return err
				}
				if a, ok := v.untyped[id]; ok && a.typ == typ {
					v.parked[a] = true
				}
			}
			return rows.Err()
		})
	}
	if err := tx.SendBatch(ctx, batch).Close(); err != nil {
		return nil, fmt.Errorf("event %s: read versions: %w%s", events[0].ID, err, missingTableHint(err))
	}
	if ambiguous != nil {
		return nil, fmt.Errorf("event %s: %w", events[0].ID, ambiguous)
	}
	if len(tookOver) > 0 {
		// Rare (once per aggregate after a switch back to a format with
		// types), so a round trip of its own, after the locks: the insert
		// may have waited for the empty type's row, whose holder may have
		// parked events meanwhile.
		move := `UPDATE ` + ib.tables.parked() + ` SET aggregate_type = $2
			WHERE consumer = $1 AND aggregate_type = '' AND aggregate_id = $3`
		batch := &pgx.Batch{}
		for _, a := range tookOver {
			batch.Queue(move, ib.cfg.Consumer, a.typ, a.id).Exec(func(tag pgconn.CommandTag) error {
				if tag.RowsAffected() > 0 {
					v.parked[a] = true
				}
				return nil
			})
		}
		if err := tx.SendBatch(ctx, batch).Close(); err != nil {
			return nil, fmt.Errorf("event %s: move parked events to their aggregate type: %w", events[0].ID, err)
		}
	}
	return v, nil
}

// applyVersioned applies, skips or parks one new event with a version.
func (ib *Inbox) applyVersioned(ctx context.Context, tx pgx.Tx, v *versionState, ev Event, h Handler) (Result, *Missing, error) {
	a := v.keyOf(ev)
	applied := v.applied[a]
	switch {
	case ev.Version <= applied:
		return Result{Outcome: Stale}, nil, nil
	case ev.Version > applied+1:
		if ib.cfg.Gaps == RefuseGaps {
			return Result{}, nil, fmt.Errorf("event %s: %s %s version %d arrived after version %d: %w",
				ev.ID, ev.AggregateType, ev.AggregateID, ev.Version, applied, ErrVersionGap)
		}
		parked, missing, err := ib.park(ctx, tx, a, ev, applied)
		if err != nil {
			return Result{}, nil, err
		}
		if !parked {
			return Result{Outcome: Stale}, nil, nil
		}
		v.parked[a] = true
		// The version row is written though its version stays: a
		// transaction under REPEATABLE READ that waits for its lock then
		// fails with a serialization error instead of applying the
		// predecessor with a snapshot that misses this event.
		v.changed[a] = true
		return Result{Outcome: Parked}, missing, nil
	}
	if err := ib.run(ctx, tx, ev, h); err != nil {
		if endedBySQL(err) {
			v.applied[a], v.changed[a] = ev.Version, true
		}
		return Result{}, nil, err
	}
	last, released := ev.Version, 0
	if v.parked[a] {
		var err error
		if released, last, err = ib.release(ctx, tx, a, ev.Version, ev.ID, h); err != nil {
			if endedBySQL(err) {
				v.applied[a], v.changed[a] = last, true
			}
			return Result{}, nil, err
		}
	}
	v.applied[a] = last
	v.changed[a] = true
	return Result{Outcome: Applied, Released: released}, nil, nil
}

// storeVersions writes the versions the batch moved, one primary-key
// update per aggregate, pipelined in one round trip (see lockVersions).
func (ib *Inbox) storeVersions(ctx context.Context, tx pgx.Tx, v *versionState) error {
	if len(v.changed) == 0 {
		return nil
	}
	update := `UPDATE ` + ib.tables.versions() + ` SET version = $4
		WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3`
	batch := &pgx.Batch{}
	for a := range v.changed {
		batch.Queue(update, ib.cfg.Consumer, a.typ, a.id, v.applied[a])
	}
	if err := tx.SendBatch(ctx, batch).Close(); err != nil {
		return fmt.Errorf("store versions: %w", err)
	}
	return nil
}
