package poll

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/store"
)

// claimSQL claims up to $1 rows in one short transaction (the statement
// alone), in insertion order, leasing them to $2 for $3 milliseconds, and
// returns them joined with their outbox rows. `bounded` keeps the longest
// prefix (at least one row) whose values add up to $5 bytes at most, so a
// batch of large rows holds no more than its share of
// --max-in-flight-bytes; a row over $6 bytes (--max-message-bytes) counts
// for nothing there, and its values are never read (NULL), so that it is
// quarantined by reference.
//
// Per-aggregate order: a row is claimed only when no earlier row of its
// aggregate is unpublished, unless that earlier row is claimed in the same
// statement. `picked` leaves out, before the LIMIT, every row behind one
// that cannot be claimed now (leased elsewhere, backing off, quarantined),
// so a blocked aggregate never fills the batch and starves the others.
// `ready` then drops a row whose earlier row was claimable but skipped as
// locked by a poller claiming at this very moment.
//
// The scan starts at the oldest pending row, the first in the pending
// rows' index: every row before it is published or quarantined. (min()
// would be the same, but with statistics taken while nothing was pending
// the planner counted every pending row through the aggregates' index for
// it: 85 ms per claim at 200,000 pending.) Without that
// bound the claim's generic plan may walk the primary key from the
// table's first row, through every published row not yet deleted by
// retention: measured at 300,000 rows, a plan that did cost 180 µs per
// claimed row against 60, and it grows with the table.
//
// SKIP LOCKED keeps concurrent pollers apart; a row another poller leased
// and committed since this statement's snapshot fails the re-check of the
// lease condition on the locked row, so two pollers never hold a valid
// lease on one row.
//
// A lease is valid while it has not expired and the session that took it
// still exists ({{lease_dead_*}}): a poller that died leaves leases that
// are free at once, whatever its worker id. The claim records its own
// session ($4 false: none, and the lease lasts until it expires).
const claimSQL = `
WITH ` + liveSessionsCTE + `, picked AS (
    SELECT s.seq, s.event_id, s.aggregate_type, s.aggregate_id, s.lease_holder IS NOT NULL AS reclaimed
    FROM {{state}} s
    WHERE s.published_at IS NULL AND s.quarantined_at IS NULL
      AND s.seq >= (SELECT h.seq FROM {{state}} h WHERE h.published_at IS NULL AND h.quarantined_at IS NULL ORDER BY h.seq LIMIT 1)
      AND s.next_attempt_at <= now()
      AND (s.lease_expires_at IS NULL OR s.lease_expires_at <= now() OR {{lease_dead_s}})
      AND NOT EXISTS (
          SELECT 1 FROM {{state}} e
          WHERE e.aggregate_type = s.aggregate_type AND e.aggregate_id = s.aggregate_id
            AND e.seq < s.seq AND e.published_at IS NULL
            AND (e.quarantined_at IS NOT NULL OR e.next_attempt_at > now() OR (e.lease_expires_at > now() AND NOT {{lease_dead_e}}))
          OFFSET 0)
    ORDER BY s.seq
    LIMIT $1
    FOR UPDATE OF s SKIP LOCKED
), ready AS (
    SELECT p.seq, p.event_id, p.reclaimed FROM picked p
    WHERE NOT EXISTS (
        SELECT 1 FROM {{state}} e
        WHERE e.aggregate_type = p.aggregate_type AND e.aggregate_id = p.aggregate_id
          AND e.seq < p.seq AND e.published_at IS NULL
          AND e.seq NOT IN (SELECT seq FROM picked)
        OFFSET 0)
), sized AS (
    SELECT r.seq, r.reclaimed, {{size}} AS size
    FROM ready r LEFT JOIN LATERAL (SELECT * FROM {{outbox}} o WHERE o.{{event_id}} = r.event_id) o ON true
), bounded AS (
    SELECT b.seq, b.reclaimed, b.size FROM (
        SELECT z.*, row_number() OVER w AS n, sum(CASE WHEN z.size > $6 THEN 0 ELSE z.size END) OVER w AS upto
        FROM sized z WINDOW w AS (ORDER BY z.seq)) b
    WHERE b.n = 1 OR b.upto <= $5
), claimed AS (
    UPDATE {{state}} s
    SET lease_holder = $2, lease_expires_at = now() + $3 * interval '1 millisecond', attempts = s.attempts + 1,
        lease_pid = CASE WHEN $4 THEN pg_backend_pid() END,
        lease_backend_start = CASE WHEN $4 THEN (SELECT a.backend_start FROM pg_stat_get_activity(pg_backend_pid()) a) END
    FROM bounded WHERE s.seq = bounded.seq
    RETURNING s.seq, s.event_id, s.attempts, s.inserted_at, bounded.reclaimed, bounded.size
)
SELECT c.seq, c.attempts, c.inserted_at, c.reclaimed, o.{{event_id}} IS NOT NULL, c.event_id::text, c.size,
    (SELECT count(*) FROM sized) > (SELECT count(*) FROM bounded), {{guarded}}
FROM claimed c LEFT JOIN LATERAL (SELECT * FROM {{outbox}} o WHERE o.{{event_id}} = c.event_id) o ON true
ORDER BY c.seq`

// liveSessionsCTE lists the server's sessions once per statement, for
// leaseDead. pg_stat_get_activity is what pg_stat_activity reads, without
// its joins; any role may call it.
const liveSessionsCTE = `live AS MATERIALIZED (SELECT pid, backend_start FROM pg_stat_get_activity(NULL) WHERE pid IS NOT NULL)`

// leaseDead is true for a lease whose session is gone: no session has its
// PID and start time (a PID alone can be reused). A role may see another
// role's sessions with their PID but a NULL start time; one of those with
// the lease's PID may be the holder, so it counts as alive, and the lease
// then ends at its expiry. A lease with no session recorded is left to
// its expiry too. Both tests are hashed NOT IN subplans over live: a claim
// passes every leased row at the head of the queue, so each must cost a
// lookup, not a scan.
func leaseDead(alias string) string {
	return strings.ReplaceAll(`(x.lease_pid IS NOT NULL
        AND (x.lease_pid, x.lease_backend_start) NOT IN (SELECT pid, backend_start FROM live WHERE backend_start IS NOT NULL)
        AND x.lease_pid NOT IN (SELECT pid FROM live WHERE backend_start IS NULL))`, "x.", alias+".")
}

// claimed is one row a claim returned.
type claimed struct {
	seq        int64
	attempts   int
	insertedAt time.Time
	// reclaimed: the row's previous lease expired before it was
	// published; its poller may still publish it too.
	reclaimed bool
	// gone: the outbox row was deleted while its state said pending.
	gone bool
	// size is the row's values' bytes; over --max-message-bytes, they
	// were not read.
	size int64
	// cut: the claim left rows out for the batch's byte bound, so more
	// are pending (a backlog) though the batch has fewer rows than
	// --poll-batch.
	cut     bool
	ev      event.Event
	eventID string
	aggKey  string // aggregate type and id, to keep order within a batch
}

// queries runs a poller's statements on its connection.
type queries struct {
	conn     *pgx.Conn
	t        tables
	layout   *layout.Layout
	claim    string
	peek     string // peekSQL, for a dry run
	workerID string
	// sessionCheck records the claiming session in each lease (see
	// Config.SessionCheck).
	sessionCheck bool
	// payloadBinary says the payload column is a bytea, which claim
	// reads in its text form, as the WAL path gets it.
	payloadBinary bool
}

func newQueries(ctx context.Context, conn *pgx.Conn, t tables, l *layout.Layout, workerID string, sessionCheck bool) (*queries, error) {
	if err := checkTables(ctx, conn, t); err != nil {
		return nil, err
	}
	exprs, payloadBinary, err := store.EventColumnExprs(ctx, conn, t.outbox, l, "o")
	if err != nil {
		return nil, err
	}
	sized := newSizedColumns(exprs)
	claim := strings.NewReplacer("{{state}}", t.state.Quoted(), "{{outbox}}", t.outbox.Quoted(), "{{size}}", sized.size,
		"{{guarded}}", sized.guarded("c.size > $6"), "{{event_id}}", pgx.Identifier{l.Column(layout.EventID)}.Sanitize(),
		"{{lease_dead_s}}", leaseDead("s"), "{{lease_dead_e}}", leaseDead("e")).Replace(claimSQL)
	peek := strings.NewReplacer("{{state}}", t.state.Quoted(), "{{outbox}}", t.outbox.Quoted(), "{{size}}", sized.size,
		"{{guarded}}", sized.guarded(sized.size+" > $3"), "{{event_id}}", pgx.Identifier{l.Column(layout.EventID)}.Sanitize()).Replace(peekSQL)
	return &queries{conn: conn, t: t, layout: l, claim: claim, peek: peek, workerID: workerID, sessionCheck: sessionCheck,
		payloadBinary: payloadBinary}, nil
}

// checkTables names what `migrate --source poll` would have created and is
// missing, and the privileges the poller lacks, before the first claim.
func checkTables(ctx context.Context, conn *pgx.Conn, t tables) error {
	if err := pg.RequireSchemaUsage(ctx, conn, t.outbox.Schema, t.state.Schema, t.quarantine.Schema); err != nil {
		return err
	}
	var stateExists, triggerExists bool
	err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL,
		EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($2) AND tgname = $3 AND tgenabled IN ('O', 'A'))`,
		t.state.Quoted(), t.outbox.Quoted(), t.state.Name+"_track").Scan(&stateExists, &triggerExists)
	if err != nil {
		return fmt.Errorf("look up poll mode's tables: %w", err)
	}
	if !stateExists || !triggerExists {
		return fmt.Errorf("%w: poll mode's state table %s or the trigger %s_track on %s is missing (or disabled): rows inserted now would never be published; run `outbox-relay migrate --source poll` as the schema's owner",
			pg.ErrPrecondition, t.state, t.state.Name, t.outbox)
	}
	var leaseColumns bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'lease_backend_start' AND NOT attisdropped)`,
		t.state.Quoted()).Scan(&leaseColumns); err != nil {
		return fmt.Errorf("look up poll mode's tables: %w", err)
	}
	if !leaseColumns {
		return fmt.Errorf("%w: poll mode's state table %s predates this release (no lease_pid, lease_backend_start): run `outbox-relay migrate --source poll` as the schema's owner; it adds them and changes no row",
			pg.ErrPrecondition, t.state)
	}
	for _, need := range []struct {
		table store.Table
		privs []string
	}{
		{t.outbox, []string{"SELECT", "DELETE"}},
		{t.state, []string{"SELECT", "UPDATE", "DELETE"}},
		{t.quarantine, []string{"SELECT", "INSERT", "UPDATE"}},
	} {
		for _, priv := range need.privs {
			var ok bool
			var role string
			if err := conn.QueryRow(ctx, "SELECT current_user, has_table_privilege($1, $2)", need.table.Quoted(), priv).Scan(&role, &ok); err != nil {
				return fmt.Errorf("%w: check %s on %s: %v (run `outbox-relay migrate --source poll`)", pg.ErrPrecondition, priv, need.table, err)
			}
			if !ok {
				return fmt.Errorf("%w: role %s lacks %s on %s, which poll mode needs: GRANT %s ON %s TO %s",
					pg.ErrPrecondition, role, priv, need.table, priv, need.table.Quoted(), pgx.Identifier{role}.Sanitize())
			}
		}
	}
	return nil
}

// peekSQL reads up to $2 pending rows after sequence number $1 in the
// order claims take them, as claimSQL returns them, and changes nothing:
// a dry run's read. It ignores leases and backoffs, which say when a row
// is sent, not what is sent.
const peekSQL = `
SELECT s.seq, s.attempts, s.inserted_at, false, o.{{event_id}} IS NOT NULL, s.event_id::text, {{size}}, false, {{guarded}}
FROM {{state}} s LEFT JOIN LATERAL (SELECT * FROM {{outbox}} o WHERE o.{{event_id}} = s.event_id) o ON true
WHERE s.published_at IS NULL AND s.quarantined_at IS NULL AND s.seq > $1
ORDER BY s.seq
LIMIT $2`

// peekBatch reads up to n pending rows after sequence number after.
func (q *queries) peekBatch(ctx context.Context, after int64, n, maxMessageBytes int) ([]claimed, error) {
	return q.queryClaimed(ctx, "read pending rows from", q.peek, after, n, maxMessageBytes)
}

// claimBatch leases up to n rows.
func (q *queries) claimBatch(ctx context.Context, n int, bytes int64, maxMessageBytes int, lease time.Duration) ([]claimed, error) {
	return q.queryClaimed(ctx, "claim rows from", q.claim, n, q.workerID, lease.Milliseconds(), q.sessionCheck, bytes, maxMessageBytes)
}

// queryClaimed runs a statement that returns rows as claimSQL does; what
// says what it does, for its errors.
func (q *queries) queryClaimed(ctx context.Context, what, sql string, args ...any) ([]claimed, error) {
	rows, err := q.conn.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", what, q.t.state, err)
	}
	defer rows.Close()
	var out []claimed
	for rows.Next() {
		c, err := scanClaimed(rows, q.layout, q.payloadBinary)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("%s %s: %w", what, q.t.state, err)
	}
	return out, nil
}

// scanClaimed reads one row of claimSQL: six fixed columns, then the
// event's, all text or NULL; payloadBinary says the payload is a bytea's
// text form.
func scanClaimed(rows pgx.Rows, l *layout.Layout, payloadBinary bool) (claimed, error) {
	var c claimed
	values, err := rows.Values()
	if err != nil {
		return c, fmt.Errorf("read claimed row: %w", err)
	}
	const fixed = 8
	eventColumns := int(layout.NumFields) + len(l.HeaderColumns)
	if len(values) != fixed+eventColumns {
		return c, fmt.Errorf("read claimed row: %d columns, want %d", len(values), fixed+eventColumns)
	}
	var ok [fixed]bool
	var attempts int32
	var present bool
	c.seq, ok[0] = values[0].(int64)
	attempts, ok[1] = values[1].(int32)
	c.insertedAt, ok[2] = values[2].(time.Time)
	c.reclaimed, ok[3] = values[3].(bool)
	present, ok[4] = values[4].(bool)
	c.eventID, ok[5] = values[5].(string)
	c.size, ok[6] = values[6].(int64)
	c.cut, ok[7] = values[7].(bool)
	for i, good := range ok {
		if !good {
			return c, fmt.Errorf("read claimed row: column %d is %T", i+1, values[i])
		}
	}
	c.attempts, c.gone = int(attempts), !present
	text := make([][]byte, eventColumns)
	for i := range text {
		if s, isText := values[fixed+i].(string); isText {
			text[i] = []byte(s)
		}
	}
	c.ev = event.OfColumns(l, text)
	c.ev.PayloadBinary = payloadBinary
	// Poll mode sees no commit time: the relay's span starts at the
	// insert, a little before it. A row tried before may be in Kafka
	// already (a lease that ended, an ack that was lost).
	c.ev.CommitTime = c.insertedAt
	c.ev.Position = uint64(c.seq)
	c.ev.Redelivery = c.reclaimed || c.attempts > 1
	c.aggKey = string(c.ev.AggregateType) + "\x00" + string(c.ev.AggregateID)
	return c, nil
}

// markPublished records Kafka's ack of these rows. It is not limited to
// this poller's lease: the ack is true whoever holds the row now, and a
// poller still publishing it finds it published when it marks.
//
// The statements that change rows by sequence number name no condition on
// published_at: any would let the planner read a partial index of pending
// rows instead of the primary key, and with statistics taken while little
// was pending (an outbox's usual state) it does, for every statement:
// measured, 393 µs per event marked at 200,000 pending, against 5. A row
// published already keeps its time. Those that act only on this poller's
// leases need no such condition either: marking a row published ends its
// lease, so a leased row is never a published one.
func (q *queries) markPublished(ctx context.Context, seqs []int64) error {
	if len(seqs) == 0 {
		return nil
	}
	_, err := q.conn.Exec(ctx, q.markPublishedSQL(), seqs)
	if err != nil {
		return fmt.Errorf("mark %d rows published in %s: %w", len(seqs), q.t.state, err)
	}
	return nil
}

func (q *queries) markPublishedSQL() string {
	return "UPDATE " + q.t.state.Quoted() +
		" SET published_at = coalesce(published_at, now()), lease_holder = NULL, lease_expires_at = NULL, lease_pid = NULL, lease_backend_start = NULL WHERE seq = ANY($1)"
}

// failure is one row's failed attempt.
type failure struct {
	seq   int64
	delay time.Duration
	class string
	msg   string
}

// markFailed schedules the rows' next attempts and releases their leases,
// only where this poller still holds them (see markPublished).
func (q *queries) markFailed(ctx context.Context, fs []failure) error {
	if len(fs) == 0 {
		return nil
	}
	seqs, delays, classes, msgs := make([]int64, len(fs)), make([]int64, len(fs)), make([]string, len(fs)), make([]string, len(fs))
	for i, f := range fs {
		seqs[i], delays[i], classes[i], msgs[i] = f.seq, f.delay.Milliseconds(), f.class, f.msg
	}
	_, err := q.conn.Exec(ctx, "UPDATE "+q.t.state.Quoted()+` s
		SET next_attempt_at = now() + f.delay_ms * interval '1 millisecond', last_error_class = f.class, last_error = f.msg,
			lease_holder = NULL, lease_expires_at = NULL, lease_pid = NULL, lease_backend_start = NULL
		FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[]) AS f(seq, delay_ms, class, msg)
		WHERE s.seq = f.seq AND s.lease_holder = $5`, seqs, delays, classes, msgs, q.workerID)
	if err != nil {
		return fmt.Errorf("record %d failed attempts in %s: %w", len(fs), q.t.state, err)
	}
	return nil
}

// release gives rows back without counting an attempt against them, where
// this poller still holds them (see markPublished).
func (q *queries) release(ctx context.Context, seqs []int64) error {
	if len(seqs) == 0 {
		return nil
	}
	_, err := q.conn.Exec(ctx, "UPDATE "+q.t.state.Quoted()+
		" SET lease_holder = NULL, lease_expires_at = NULL, lease_pid = NULL, lease_backend_start = NULL, attempts = greatest(attempts - 1, 0) WHERE seq = ANY($1) AND lease_holder = $2",
		seqs, q.workerID)
	if err != nil {
		return fmt.Errorf("release %d rows in %s: %w", len(seqs), q.t.state, err)
	}
	return nil
}

// releaseOwn frees the leases this worker id holds from an earlier session
// (or, with a stable --poll-worker-id, an earlier process): what they
// covered was never marked, and no part of this process still publishes it.
func (q *queries) releaseOwn(ctx context.Context) (int64, error) {
	tag, err := q.conn.Exec(ctx, "UPDATE "+q.t.state.Quoted()+
		" SET lease_holder = NULL, lease_expires_at = NULL, lease_pid = NULL, lease_backend_start = NULL WHERE lease_holder = $1 AND published_at IS NULL", q.workerID)
	if err != nil {
		return 0, fmt.Errorf("release this poller's earlier leases in %s: %w", q.t.state, err)
	}
	return tag.RowsAffected(), nil
}

// markQuarantined records that the row's event is in the quarantine table.
// The row stays unpublished, so later events of its aggregate wait for its
// replay.
func (q *queries) markQuarantined(ctx context.Context, seq int64, class, msg string) error {
	_, err := q.conn.Exec(ctx, "UPDATE "+q.t.state.Quoted()+
		" SET quarantined_at = now(), last_error_class = $2, last_error = $3, lease_holder = NULL, lease_expires_at = NULL, lease_pid = NULL, lease_backend_start = NULL WHERE seq = $1",
		seq, class, msg)
	if err != nil {
		return fmt.Errorf("mark row %d quarantined in %s: %w", seq, q.t.state, err)
	}
	return nil
}

// forgetGone deletes the state of rows whose outbox row no longer exists:
// there is nothing left to publish, and the state would block its
// aggregate for good.
func (q *queries) forgetGone(ctx context.Context, seqs []int64) error {
	if len(seqs) == 0 {
		return nil
	}
	_, err := q.conn.Exec(ctx, "DELETE FROM "+q.t.state.Quoted()+" WHERE seq = ANY($1)", seqs)
	if err != nil {
		return fmt.Errorf("forget %d rows deleted from %s: %w", len(seqs), q.t.outbox, err)
	}
	return nil
}

// settleReplayed marks published the quarantined rows that `quarantine
// replay` delivered, which lets their aggregates go on.
func (q *queries) settleReplayed(ctx context.Context) (int64, error) {
	tag, err := q.conn.Exec(ctx, "UPDATE "+q.t.state.Quoted()+" s SET published_at = r.replayed_at FROM "+q.t.quarantine.Quoted()+
		" r WHERE s.quarantined_at IS NOT NULL AND s.published_at IS NULL AND r.event_id = s.event_id AND r.replayed_at IS NOT NULL")
	if err != nil {
		return 0, fmt.Errorf("settle replayed events in %s: %w", q.t.state, err)
	}
	return tag.RowsAffected(), nil
}

// Stats is poll mode's state as PostgreSQL holds it.
type Stats struct {
	// Pending rows wait to be published, Quarantined ones for a replay
	// (they count in Pending too); Leased are claimed by a live poller now
	// (a lease whose session ended is free, and not counted), BackingOff
	// wait for their next attempt.
	Pending     int64 `json:"pending"`
	Quarantined int64 `json:"quarantined"`
	Leased      int64 `json:"leased"`
	BackingOff  int64 `json:"backing_off"`
	// OldestPending is when the oldest pending row was inserted.
	OldestPending *time.Time `json:"oldest_pending_inserted_at,omitempty"`
	// Pollers are the lease holders seen now.
	Pollers []string `json:"pollers"`
}

// ReadStats reads Stats through the pending rows' index.
func ReadStats(ctx context.Context, conn *pgx.Conn, state store.Table) (Stats, error) {
	var s Stats
	held := "s.lease_expires_at > now() AND NOT " + leaseDead("s")
	err := conn.QueryRow(ctx, `WITH `+liveSessionsCTE+` SELECT count(*), count(*) FILTER (WHERE quarantined_at IS NOT NULL),
			count(*) FILTER (WHERE `+held+`), count(*) FILTER (WHERE next_attempt_at > now() AND quarantined_at IS NULL),
			min(inserted_at), COALESCE(array_agg(DISTINCT lease_holder) FILTER (WHERE `+held+`), '{}')
		FROM `+state.Quoted()+` s WHERE published_at IS NULL`).
		Scan(&s.Pending, &s.Quarantined, &s.Leased, &s.BackingOff, &s.OldestPending, &s.Pollers)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
			return s, fmt.Errorf("%w: %s does not exist: run `outbox-relay migrate --source poll`", pg.ErrPrecondition, state)
		}
		return s, fmt.Errorf("read poll state from %s: %w", state, err)
	}
	return s, nil
}

// retainable counts the published rows inserted before cutoff.
func (q *queries) retainable(ctx context.Context, cutoff time.Time) (int64, error) {
	var n int64
	if err := q.conn.QueryRow(ctx, "SELECT count(*) FROM "+q.publishedCreatedBefore(), cutoff).Scan(&n); err != nil {
		return 0, fmt.Errorf("count published rows inserted before %s in %s: %w", cutoff.UTC().Format(time.RFC3339), q.t.state, err)
	}
	return n, nil
}

// publishedCreatedBefore is the FROM and WHERE of the published rows (by
// the state table's mark) inserted before $1 (by the outbox's
// --column-created-at, as retention selects in every source). A pending or
// quarantined row has no published_at, so it can never match.
func (q *queries) publishedCreatedBefore() string {
	return q.t.state.Quoted() + ` s JOIN ` + q.t.outbox.Quoted() + ` o ON o.` + pgx.Identifier{q.layout.Column(layout.EventID)}.Sanitize() +
		` = s.event_id WHERE s.published_at IS NOT NULL AND o.` + pgx.Identifier{q.layout.Column(layout.CreatedAt)}.Sanitize() + ` < $1`
}

// deletePublished deletes up to batch published rows inserted before
// cutoff, from the outbox and the state table together. The outbox row is
// found by the layout's event id column (a Debezium table's is id); the
// state table's own column is always event_id.
func (q *queries) deletePublished(ctx context.Context, cutoff time.Time, batch int) (int64, error) {
	tag, err := q.conn.Exec(ctx, `WITH doomed AS (
			SELECT s.seq, s.event_id FROM `+q.publishedCreatedBefore()+` ORDER BY s.seq LIMIT $2 FOR UPDATE OF s SKIP LOCKED
		), outbox AS (
			DELETE FROM `+q.t.outbox.Quoted()+` o USING doomed d WHERE o.`+pgx.Identifier{q.layout.Column(layout.EventID)}.Sanitize()+` = d.event_id
		)
		DELETE FROM `+q.t.state.Quoted()+` s USING doomed d WHERE s.seq = d.seq`, cutoff, batch)
	if err != nil {
		return 0, fmt.Errorf("delete published rows from %s: %w", q.t.outbox, err)
	}
	return tag.RowsAffected(), nil
}
