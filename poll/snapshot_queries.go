package poll

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/store"
)

// snapProgress is the snapshot strategy's progress row: every row whose
// transaction is visible in Done is in Kafka; Window, when set, is the
// snapshot being published, up to sequence number AfterSeq; and while
// Existing is set, the rows from before the strategy (no transaction id)
// are published first, in (created at, event id) order after
// ExistingAfter. ExistingByLease says the lease strategy's state table
// picks those rows, as it holds them pending, and orders them by its seq
// (ExistingAfterSeq) instead.
type snapProgress struct {
	Done     string
	Window   string
	AfterSeq int64
	Existing bool
	// ExistingByLease: a switch from the lease strategy; the rows from
	// before are those its state table holds as pending, in its order.
	ExistingByLease  bool
	ExistingAfterSeq int64
	// ExistingAfter is the last row from before the strategy published:
	// its insert time (zero without that column) and event id.
	ExistingAfterCreated time.Time
	ExistingAfterID      string
	UpdatedAt            time.Time
}

// windowSQL reads the rows of the transactions that became visible between
// snapshot $1 and snapshot $2, after sequence number $3, in insertion
// order. Those transactions are the ones $1 saw in progress, and those
// that began at or after $1's xmax, that $2 sees committed: each part is
// one lookup of the transaction id index (PgQ's batch query), however old
// $1's oldest open transaction is. A transaction that commits late is in
// the window in which it becomes visible, never behind a high-water mark.
const windowSQL = `
SELECT {{outer}} FROM (
    SELECT o.{{seq}} AS seq, {{created}} AS created, o.{{event_id}}::text AS eid, {{key}} FROM {{outbox}} o
    WHERE o.{{xid}} = ANY (ARRAY(SELECT pg_snapshot_xip($1::pg_snapshot)))
      AND pg_visible_in_snapshot(o.{{xid}}, $2::pg_snapshot) AND o.{{seq}} > $3
    UNION ALL
    SELECT o.{{seq}}, {{created}}, o.{{event_id}}::text, {{key}} FROM {{outbox}} o
    WHERE o.{{xid}} >= pg_snapshot_xmax($1::pg_snapshot) AND o.{{xid}} < pg_snapshot_xmax($2::pg_snapshot)
      AND pg_visible_in_snapshot(o.{{xid}}, $2::pg_snapshot) AND o.{{seq}} > $3
    OFFSET 0) x ORDER BY 1`

// The window's, and the existing pass's, cursors read each row's key
// (where it is: its partition and ctid, valid while the window is read,
// since only retention deletes, and never a row not yet covered), its
// size, and its values only when they are small ({{inline}} bytes at
// most, so that a FETCH of --poll-batch rows stays within a page's byte
// bound): a larger row's values are read by valuesSQL once its page is
// cut to that bound, and those of a row over --max-message-bytes never.
// The inner query converts each value to text once (OFFSET 0 keeps the
// planner from copying the conversions into the outer expressions); the
// outer one measures and guards the texts.
const keySQL = `o.tableoid::text || '/' || o.ctid::text AS at, o.ctid::text AS ctid, {{texts}}`

// valuesSQL reads the values of a page's rows, by ctid ($1; on a
// partitioned table a ctid may name a row in each partition, so each row
// read says where it is, and the caller keeps those of its page). A row
// not in $2 (the page's rows within --max-message-bytes) gets NULL for its
// large values, which are never read.
const valuesSQL = `
SELECT o.tableoid::text || '/' || o.ctid::text, {{guarded}} FROM {{outbox}} o WHERE o.ctid = ANY ($1::text[]::tid[])`

// existingSQL reads the rows from before the strategy, oldest first, after
// the row ($1, $2).
const existingSQL = `
SELECT {{outer}} FROM (
    SELECT 0::bigint AS seq, {{created}} AS created, o.{{event_id}}::text AS eid, {{key}} FROM {{outbox}} o
    WHERE o.{{xid}} IS NULL AND {{existing_after}}
    OFFSET 0) x
ORDER BY {{existing_order}}`

// existingLeaseSQL reads the rows from before the strategy that the lease
// strategy's state table holds as pending (neither published nor
// quarantined), in its insertion order, after its seq $1: a switch from
// the lease strategy publishes what it had not, and only that.
const existingLeaseSQL = `
SELECT {{outer}} FROM (
    SELECT s.seq AS seq, {{created}} AS created, o.{{event_id}}::text AS eid, {{key}} FROM {{state}} s JOIN {{outbox}} o ON o.{{event_id}} = s.event_id
    WHERE s.published_at IS NULL AND s.quarantined_at IS NULL AND o.{{xid}} IS NULL AND s.seq > $1
    OFFSET 0) x
ORDER BY x.seq`

// gaugesSQL reads what snapshotGauges reports. The backlog is the
// committed rows the progress does not cover, found as a window finds
// them: those of its in-progress transactions, by id, and the later ones,
// an index range from its xmax; plus the rows from before the strategy
// while they are still to publish. Not a range from its xmin, which would
// read every row inserted since the oldest transaction open when the
// progress was taken, however long ago, at every reading.
const gaugesSQL = `
SELECT extract(epoch FROM now() - s.updated_at)::float8,
    coalesce(extract(epoch FROM now() - least(
        (SELECT min(xact_start) FROM pg_stat_activity WHERE backend_xid IS NOT NULL),
        (SELECT min(prepared) FROM pg_prepared_xacts)))::float8, 0),
    w.n + CASE WHEN s.existing_pending THEN (SELECT count(*) {{existing_rows}}) ELSE 0 END,
    least(w.oldest, CASE WHEN s.existing_pending THEN (SELECT min({{created}}) {{existing_rows}}) END)
FROM {{snapshot}} s
CROSS JOIN LATERAL (
    SELECT count(*) AS n, min(p.created) AS oldest FROM (
        SELECT {{created}} AS created FROM {{outbox}} o
        WHERE o.{{xid}} = ANY (ARRAY(SELECT pg_snapshot_xip(s.done))) AND pg_xact_status(o.{{xid}}) = 'committed'
        UNION ALL
        SELECT {{created}} FROM {{outbox}} o
        WHERE o.{{xid}} >= pg_snapshot_xmax(s.done) AND pg_xact_status(o.{{xid}}) = 'committed'
    ) p
) w`

// snapQueries are the snapshot strategy's statements on an outbox table.
type snapQueries struct {
	t        tables
	layout   *layout.Layout
	window   string
	existing string
	values   string
	// inline keeps the cursors' queries before setInline.
	inline map[*string]string
	// existingLease is existingLeaseSQL; empty when the table has no
	// lease state table.
	existingLease string
	gauges        string
	payloadBinary bool
	// hasCreated says the table has the insert-time column.
	hasCreated bool
}

// newSnapQueries checks what `migrate --poll-strategy snapshot` creates
// and the privileges the poller needs, and builds the statements.
func newSnapQueries(ctx context.Context, conn *pgx.Conn, t tables, l *layout.Layout) (*snapQueries, error) {
	if err := checkSnapTables(ctx, conn, t); err != nil {
		return nil, err
	}
	exprs, payloadBinary, err := store.EventColumnExprs(ctx, conn, t.outbox, l, "o")
	if err != nil {
		return nil, err
	}
	sized := newSizedColumns(exprs)
	var hasCreated, hasLeaseState bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped), to_regclass($3) IS NOT NULL",
		t.outbox.Quoted(), l.Column(layout.CreatedAt), t.state.Quoted()).Scan(&hasCreated, &hasLeaseState); err != nil {
		return nil, fmt.Errorf("look up %s's columns: %w", t.outbox, err)
	}
	eventID := "o." + quoteIdent(l.Column(layout.EventID))
	created, after, order := "NULL::timestamptz", eventID+"::text > $1::text", "x.eid"
	if hasCreated {
		c := "o." + quoteIdent(l.Column(layout.CreatedAt))
		created = c
		after = "(" + c + ", " + eventID + "::text) > ($1::timestamptz, $2::text)"
		order = "x.created, x.eid"
	}
	texts, inner := make([]string, len(exprs)), make([]string, len(exprs))
	for i, e := range exprs {
		texts[i], inner[i] = fmt.Sprintf("%s AS c%d", e, i), fmt.Sprintf("x.c%d", i)
	}
	measured := newSizedColumns(inner)
	outer := "x.seq, x.created, x.eid, x.at, x.ctid, " + measured.size + ", " + measured.guarded(measured.size+" > {{inline}}")
	eventIDColumn, xid := quoteIdent(l.Column(layout.EventID)), quoteIdent(store.SnapshotXidColumn)
	existingRows := "FROM " + t.outbox.Quoted() + " o WHERE o." + xid + " IS NULL"
	if hasLeaseState {
		// The rows the existing pass has still to read.
		existingRows = "FROM " + t.outbox.Quoted() + " o WHERE o." + xid + " IS NULL AND (NOT s.existing_by_lease_state OR EXISTS (SELECT 1 FROM " +
			t.state.Quoted() + " ps WHERE ps.event_id = o." + eventIDColumn +
			" AND ps.published_at IS NULL AND ps.quarantined_at IS NULL AND ps.seq > coalesce(s.existing_after_seq, 0)))"
	}
	r := strings.NewReplacer("{{outbox}}", t.outbox.Quoted(), "{{snapshot}}", t.snapshot.Quoted(), "{{state}}", t.state.Quoted(),
		"{{key}}", strings.ReplaceAll(keySQL, "{{texts}}", strings.Join(texts, ", ")), "{{outer}}", outer,
		"{{guarded}}", sized.guarded("NOT (o.tableoid::text || '/' || o.ctid::text = ANY ($2::text[]))"),
		"{{created}}", created,
		"{{event_id}}", eventIDColumn, "{{xid}}", xid, "{{existing_rows}}", existingRows,
		"{{seq}}", quoteIdent(store.OrderColumn), "{{existing_after}}", after, "{{existing_order}}", order)
	q := &snapQueries{t: t, layout: l, window: r.Replace(windowSQL), existing: r.Replace(existingSQL), gauges: r.Replace(gaugesSQL), values: r.Replace(valuesSQL),
		payloadBinary: payloadBinary, hasCreated: hasCreated}
	if hasLeaseState {
		q.existingLease = r.Replace(existingLeaseSQL)
	}
	q.setInline(0)
	return q, nil
}

// setInline makes the cursors bring the values of rows of up to bytes
// bytes with their keys (see keySQL).
func (q *snapQueries) setInline(bytes int64) {
	if q.inline == nil {
		q.inline = map[*string]string{&q.window: q.window, &q.existing: q.existing, &q.existingLease: q.existingLease}
	}
	for query, template := range q.inline {
		*query = strings.ReplaceAll(template, "{{inline}}", strconv.FormatInt(bytes, 10))
	}
}

// existingQuery is the query of the rows from before the strategy, and
// its arguments: the last such row published, or nothing yet.
func (q *snapQueries) existingQuery(p snapProgress) (string, []any, error) {
	if !p.ExistingByLease {
		return q.existing, q.existingAfter(p), nil
	}
	if q.existingLease == "" {
		return "", nil, fmt.Errorf("%w: the lease strategy's state table %s, which says which rows from before the snapshot strategy are still to publish, is gone before they all were: restore it, or, if every row of %s without an %s was published, run `UPDATE %s SET existing_pending = false`",
			pg.ErrPrecondition, q.t.state, q.t.outbox, store.SnapshotXidColumn, q.t.snapshot)
	}
	return q.existingLease, []any{p.ExistingAfterSeq}, nil
}

// existingAfter are existingSQL's arguments: the last row from before the
// strategy published, or nothing yet.
func (q *snapQueries) existingAfter(p snapProgress) []any {
	if !q.hasCreated {
		return []any{p.ExistingAfterID}
	}
	if p.ExistingAfterID == "" {
		return []any{"-infinity", ""}
	}
	return []any{p.ExistingAfterCreated, p.ExistingAfterID}
}

func quoteIdent(name string) string { return pgx.Identifier{name}.Sanitize() }

// checkSnapTables names what migrate would have created and is missing,
// and the privileges the poller lacks.
func checkSnapTables(ctx context.Context, conn *pgx.Conn, t tables) error {
	if err := pg.RequireSchemaUsage(ctx, conn, t.outbox.Schema, t.snapshot.Schema, t.quarantine.Schema); err != nil {
		return err
	}
	var progress, columns, defaults, stamp bool
	err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'existing_after_seq'),
		(SELECT count(*) = 2 FROM pg_attribute WHERE attrelid = to_regclass($2) AND attname IN ($3, $4) AND NOT attisdropped),
		(SELECT count(*) = 2 FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
		 WHERE d.adrelid = to_regclass($2) AND a.attname IN ($3, $4)),
		EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($2) AND tgname = $5 AND tgenabled IN ('O', 'A'))`,
		t.snapshot.Quoted(), t.outbox.Quoted(), store.SnapshotXidColumn, store.OrderColumn, store.StampTrigger(t.outbox)).Scan(&progress, &columns, &defaults, &stamp)
	if err != nil {
		return fmt.Errorf("look up the snapshot strategy's tables: %w", err)
	}
	if !progress || !columns || !defaults {
		return fmt.Errorf("%w: the snapshot strategy's progress table %s, or the columns %s and %s of %s with their defaults, are missing: rows inserted now would never be published; run `outbox-relay migrate --source poll --poll-strategy snapshot` as the schema's owner",
			pg.ErrPrecondition, t.snapshot, store.SnapshotXidColumn, store.OrderColumn, t.outbox)
	}
	if !stamp {
		return stampOffError(t)
	}
	for _, need := range []struct {
		table store.Table
		privs []string
	}{
		{t.outbox, []string{"SELECT"}},
		{t.snapshot, []string{"SELECT", "UPDATE"}},
		{t.quarantine, []string{"SELECT", "INSERT", "UPDATE"}},
	} {
		if err := pg.RequireTablePrivileges(ctx, conn, need.table.Quoted(), need.privs, "poll mode's snapshot strategy"); err != nil {
			return err
		}
	}
	return nil
}

// leaseTriggerLeft says whether the lease strategy's trigger still writes
// a state row per event into the table, which the snapshot strategy does
// not read.
func leaseTriggerLeft(ctx context.Context, conn *pgx.Conn, t tables) (bool, error) {
	state, err := store.PollStateTable(t.outbox)
	if err != nil {
		return false, nil // no such name can exist
	}
	var left bool
	err = conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = $2 AND tgenabled <> 'D')",
		t.outbox.Quoted(), state.Name+"_track").Scan(&left)
	if err != nil {
		return false, fmt.Errorf("look up the lease strategy's trigger: %w", err)
	}
	return left, nil
}

// readSnapProgress reads the progress row.
func readSnapProgress(ctx context.Context, conn *pgx.Conn, t tables) (snapProgress, error) {
	var p snapProgress
	var window, afterID *string
	var afterSeq, existingAfterSeq *int64
	var afterCreated *time.Time
	err := conn.QueryRow(ctx, `SELECT done::text, window_end::text, window_after_seq, existing_pending, existing_after_created,
		existing_after_id, updated_at, existing_by_lease_state, existing_after_seq FROM `+t.snapshot.Quoted()).
		Scan(&p.Done, &window, &afterSeq, &p.Existing, &afterCreated, &afterID, &p.UpdatedAt, &p.ExistingByLease, &existingAfterSeq)
	if errors.Is(err, pgx.ErrNoRows) {
		return p, fmt.Errorf("%w: the snapshot strategy's progress table %s has no row: run `outbox-relay migrate --source poll --poll-strategy snapshot`, which writes it",
			pg.ErrPrecondition, t.snapshot)
	}
	if err != nil {
		return p, fmt.Errorf("read the snapshot strategy's progress from %s: %w", t.snapshot, err)
	}
	if window != nil {
		p.Window = *window
	}
	if afterSeq != nil {
		p.AfterSeq = *afterSeq
	}
	if afterCreated != nil {
		p.ExistingAfterCreated = *afterCreated
	}
	if afterID != nil {
		p.ExistingAfterID = *afterID
	}
	if existingAfterSeq != nil {
		p.ExistingAfterSeq = *existingAfterSeq
	}
	return p, nil
}

// writeSnapProgress stores p as the progress row.
func writeSnapProgress(ctx context.Context, conn *pgx.Conn, t tables, p snapProgress) error {
	var window, afterID *string
	var afterSeq, existingAfterSeq *int64
	var afterCreated *time.Time
	if p.Existing && p.ExistingAfterSeq != 0 {
		existingAfterSeq = &p.ExistingAfterSeq
	}
	if p.Window != "" {
		window, afterSeq = &p.Window, &p.AfterSeq
	}
	if p.Existing && p.ExistingAfterID != "" {
		afterID = &p.ExistingAfterID
		if !p.ExistingAfterCreated.IsZero() {
			afterCreated = &p.ExistingAfterCreated
		}
	}
	tag, err := conn.Exec(ctx, `UPDATE `+t.snapshot.Quoted()+` SET done = $1::pg_snapshot, window_end = $2::pg_snapshot, window_after_seq = $3,
		existing_pending = $4, existing_after_created = $5, existing_after_id = $6, existing_after_seq = $7, updated_at = now()`,
		p.Done, window, afterSeq, p.Existing, afterCreated, afterID, existingAfterSeq)
	if err != nil {
		return fmt.Errorf("record the snapshot strategy's progress in %s: %w", t.snapshot, err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("%w: the snapshot strategy's progress row in %s is gone: run `outbox-relay migrate --source poll --poll-strategy snapshot`",
			pg.ErrPrecondition, t.snapshot)
	}
	return nil
}

// snapRow is one outbox row a batch read.
type snapRow struct {
	seq     int64
	created time.Time // zero without the column
	eventID string
	// size is the row's values' bytes; over --max-message-bytes, they
	// were not read.
	size int64
	ev   event.Event
}

// snapKey is a row as a window's cursor reads it: where it is, and its
// size, without its values.
type snapKey struct {
	seq     int64
	created time.Time
	eventID string
	// at is the row's partition and ctid, as valuesSQL names it; ctid
	// alone is what it looks up.
	at, ctid string
	size     int64
	// row is the row as the cursor read it: with its values when inline.
	row    snapRow
	inline bool
}

// snapKeyColumns are the cursor's columns before the event's.
const snapKeyColumns = 6

// scanSnapKey reads one row of a window's or the existing pass's cursor:
// its key, and its values when the cursor brought them (inline).
func scanSnapKey(rows pgx.Rows, inline int64, l *layout.Layout, payloadBinary bool) (snapKey, error) {
	var k snapKey
	var created pgtype.Timestamptz
	raw, fields, types := rows.RawValues(), rows.FieldDescriptions(), rows.Conn().TypeMap()
	if len(raw) < snapKeyColumns {
		return k, fmt.Errorf("read outbox row: %d columns", len(raw))
	}
	for i, dst := range []any{&k.seq, &created, &k.eventID, &k.at, &k.ctid, &k.size} {
		if err := types.Scan(fields[i].DataTypeOID, fields[i].Format, raw[i], dst); err != nil {
			return k, fmt.Errorf("read outbox row: column %d: %w", i+1, err)
		}
	}
	if created.Valid {
		k.created = created.Time
	}
	k.row = snapRow{seq: k.seq, created: k.created, eventID: k.eventID, size: k.size}
	// A larger row's values are NULL here but its identity: read them
	// with the page (or never, over --max-message-bytes).
	k.inline = k.size <= inline
	if err := scanSnapValues(rows, snapKeyColumns, l, payloadBinary, &k.row); err != nil {
		return k, err
	}
	return k, nil
}

// scanSnapValues reads the event's columns of one row of valuesSQL or of a
// cursor, after its fixed columns, all text or NULL, into r (whose key
// fields are set).
// The values are copied from the row's raw text into one buffer: decoding
// each into a Go value first took two allocations a column.
func scanSnapValues(rows pgx.Rows, fixed int, l *layout.Layout, payloadBinary bool, r *snapRow) error {
	raw := rows.RawValues()
	fields := rows.FieldDescriptions()
	eventColumns := int(layout.NumFields) + len(l.HeaderColumns)
	if len(raw) != fixed+eventColumns {
		return fmt.Errorf("read outbox row: %d columns, want %d", len(raw), fixed+eventColumns)
	}
	size := 0
	for i, v := range raw[fixed:] {
		// The layout casts every column that is not text or varchar,
		// whose binary form is their text.
		if oid := fields[fixed+i].DataTypeOID; oid != pgtype.TextOID && oid != pgtype.VarcharOID {
			return fmt.Errorf("read outbox row: column %d is of type %d, want text or varchar", fixed+i+1, oid)
		}
		size += len(v)
	}
	buf := make([]byte, 0, size)
	text := make([][]byte, eventColumns)
	for i, v := range raw[fixed:] {
		if v != nil { // NULL stays nil, an empty value does not
			start := len(buf)
			buf = append(buf, v...)
			text[i] = buf[start:len(buf):len(buf)]
		}
	}
	r.ev = event.OfColumns(l, text)
	r.ev.PayloadBinary = payloadBinary
	// As in the lease strategy: no commit time, the insert's instead.
	r.ev.CommitTime = r.created
	r.ev.Position = uint64(r.seq)
	return nil
}

// SnapshotStatus is the snapshot strategy's progress, for the status
// command.
type SnapshotStatus struct {
	// Done is the last snapshot whose transactions' rows are in Kafka.
	Done string `json:"done_snapshot"`
	// Window is the snapshot being published, up to WindowAfterSeq.
	Window         string `json:"window_snapshot,omitempty"`
	WindowAfterSeq int64  `json:"window_after_seq,omitempty"`
	// ExistingPending: rows from before the strategy are still being
	// published, first.
	ExistingPending bool      `json:"existing_rows_pending"`
	UpdatedAt       time.Time `json:"updated_at"`
	// LagSeconds is how long ago the progress was last stored: at least
	// every 10 s while the poller keeps up.
	LagSeconds float64 `json:"lag_seconds"`
	// Pending counts the committed rows Done does not cover: not
	// published yet, or published since the progress was last stored.
	Pending int64 `json:"pending_rows"`
}

// ReadSnapshotStatus reads the snapshot strategy's progress on a
// short-lived connection; it needs no running poller.
func ReadSnapshotStatus(ctx context.Context, cfg Config) (SnapshotStatus, error) {
	t, err := cfg.tables()
	if err != nil {
		return SnapshotStatus{}, err
	}
	conn, err := pg.Dial(ctx, cfg.Postgres)
	if err != nil {
		return SnapshotStatus{}, err
	}
	defer conn.Close(context.Background())
	q, err := newSnapQueries(ctx, conn, t, cfg.Postgres.OutboxLayout())
	if err != nil {
		return SnapshotStatus{}, err
	}
	p, err := readSnapProgress(ctx, conn, t)
	if err != nil {
		return SnapshotStatus{}, err
	}
	st := SnapshotStatus{Done: p.Done, Window: p.Window, WindowAfterSeq: p.AfterSeq, ExistingPending: p.Existing,
		UpdatedAt: p.UpdatedAt, LagSeconds: time.Since(p.UpdatedAt).Seconds()}
	var lag, oldest float64
	var oldestPending *time.Time
	if err := conn.QueryRow(ctx, q.gauges).Scan(&lag, &oldest, &st.Pending, &oldestPending); err != nil {
		return st, fmt.Errorf("count the rows the snapshot strategy has not published: %w", err)
	}
	return st, nil
}

// stampOffError says the stamp trigger is missing or does not fire for
// ordinary sessions (disabled, or ENABLE REPLICA). Without it a row
// inserted with an explicit NULL or stale transaction id would be in no
// window: never published, never counted.
func stampOffError(t tables) error {
	return fmt.Errorf("%w: the trigger %s of %s, which stamps every row with its transaction's id, is missing, disabled or enabled for replication only: a row a writer inserts with %s set (an ORM that inserts every column) would never be published; run `outbox-relay migrate --source poll --poll-strategy snapshot` as the schema's owner, which makes it and enables it ALWAYS, then republish what was written meanwhile (docs/poll-snapshot.md)",
		pg.ErrPrecondition, store.StampTrigger(t.outbox), t.outbox, store.SnapshotXidColumn)
}

// checkStamp fails while the stamp trigger does not fire for ordinary
// sessions: a running poller checks it with its gauges, so a trigger
// disabled under it stops it within a reading.
func checkStamp(ctx context.Context, conn *pgx.Conn, t tables) error {
	var on bool
	err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = $2 AND tgenabled IN ('O', 'A'))",
		t.outbox.Quoted(), store.StampTrigger(t.outbox)).Scan(&on)
	if err != nil {
		return fmt.Errorf("look up the stamp trigger: %w", err)
	}
	if !on {
		return stampOffError(t)
	}
	return nil
}
