package reconcile

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/store"
)

// lookupBatch is how many ids one `= ANY($1)` lookup carries.
const lookupBatch = 5000

// table reads the outbox and quarantine tables on one connection.
type table struct {
	conn       *pgx.Conn
	cfg        Config
	outbox     string // quoted
	outboxName store.Table
	quarantine string // quoted; empty when the table does not exist
	// replayedColumns: the quarantine table records what replay delivered.
	replayedColumns bool
	idType          string // the event_id column's type, for id lookups
	layout          *layout.Layout
	// Quoted columns of the outbox table, as the layout names them.
	idColumn, createdColumn string
	// inWindow narrows a query on the outbox table to the window.
	inWindow string
	// order sorts the window's rows oldest first (see eachWindowRow).
	order string
}

func openTable(ctx context.Context, cfg Config) (*table, error) {
	outbox, err := store.ParseTable("--table", cfg.Postgres.Table)
	if err != nil {
		return nil, err
	}
	conn, err := pg.Dial(ctx, cfg.Postgres)
	if err != nil {
		return nil, err
	}
	l := cfg.Postgres.OutboxLayout()
	if cfg.Snapshot != "" {
		if err := importSnapshot(ctx, conn, cfg.Snapshot); err != nil {
			conn.Close(context.Background())
			return nil, err
		}
	}
	t := &table{conn: conn, cfg: cfg, outbox: outbox.Quoted(), outboxName: outbox, layout: l,
		idColumn: quote(l.Column(layout.EventID)), createdColumn: quote(l.Column(layout.CreatedAt))}
	t.inWindow = " WHERE " + t.createdColumn + " >= $1 AND " + t.createdColumn + " < $2"
	err = conn.QueryRow(ctx, `SELECT format_type(atttypid, atttypmod) FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped`, t.outbox, l.Column(layout.EventID)).Scan(&t.idType)
	if err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("%w: look up %s.%s: %v (check --table, --outbox-layout and --column-event-id, and that `outbox-relay migrate` ran)",
			pg.ErrPrecondition, t.outbox, l.Column(layout.EventID), err)
	}
	if err := t.checkCreatedColumn(ctx); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	if t.order, err = t.rowOrder(ctx); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	if cfg.Quarantine.Name != "" {
		q := cfg.Quarantine.Quoted()
		var exists bool
		if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", q).Scan(&exists); err != nil {
			conn.Close(context.Background())
			return nil, fmt.Errorf("look up quarantine table: %w", err)
		}
		if exists {
			t.quarantine = q
			err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute
				WHERE attrelid = to_regclass($1) AND attname = 'replayed_topic' AND NOT attisdropped)`, q).Scan(&t.replayedColumns)
			if err != nil {
				conn.Close(context.Background())
				return nil, fmt.Errorf("look up quarantine table: %w", err)
			}
		}
	}
	return t, nil
}

func (t *table) close() { t.conn.Close(context.Background()) }

// importSnapshot opens the read-only transaction every later query of the
// connection runs in, on the exported snapshot.
func importSnapshot(ctx context.Context, conn *pgx.Conn, snapshot string) error {
	if _, err := conn.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"); err != nil {
		return fmt.Errorf("begin the snapshot's transaction: %w", err)
	}
	if _, err := conn.Exec(ctx, "SET TRANSACTION SNAPSHOT "+pg.QuoteLiteral(snapshot)); err != nil {
		return fmt.Errorf("import snapshot %s: %w", snapshot, err)
	}
	return nil
}

// quote quotes an identifier.
func quote(name string) string { return pgx.Identifier{name}.Sanitize() }

// checkCreatedColumn makes sure the window's column exists: a Debezium
// table need not have one.
func (t *table) checkCreatedColumn(ctx context.Context) error {
	column := t.layout.Column(layout.CreatedAt)
	var exists bool
	if err := t.conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = $2 AND attnum > 0 AND NOT attisdropped)`, t.outbox, column).Scan(&exists); err != nil {
		return fmt.Errorf("look up %s.%s: %w", t.outbox, column, err)
	}
	if !exists {
		return fmt.Errorf("%w: reconcile selects the window's rows by their insert time, and %s has no column %s: set --column-created-at to the table's insert-time column (one with DEFAULT now(); add it if there is none)",
			pg.ErrPrecondition, t.outbox, column)
	}
	return nil
}

// topics returns the topics the window's rows route to, and the row count.
func (t *table) topics(ctx context.Context) ([]string, int64, error) {
	namer, err := publisher.NewTopicNamer(t.cfg.Kafka.TopicTemplate)
	if err != nil {
		return nil, 0, err
	}
	eventType := "NULL::text"
	if c := t.layout.Column(layout.EventType); c != "" {
		eventType = quote(c)
	}
	rows, err := t.conn.Query(ctx, "SELECT "+quote(t.layout.Column(layout.AggregateType))+", "+eventType+", count(*) FROM "+t.outbox+t.inWindow+" GROUP BY 1, 2",
		t.cfg.Since, t.cfg.Until)
	if err != nil {
		return nil, 0, fmt.Errorf("read the window's topics: %w", err)
	}
	defer rows.Close()
	seen := map[string]bool{}
	var total int64
	for rows.Next() {
		var ev event.Event
		var n int64
		if err := rows.Scan(&ev.AggregateType, &ev.EventType, &n); err != nil {
			return nil, 0, fmt.Errorf("read the window's topics: %w", err)
		}
		seen[namer.Topic(&ev)] = true
		total += n
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("read the window's topics: %w", err)
	}
	topics := make([]string, 0, len(seen))
	for name := range seen {
		topics = append(topics, name)
	}
	sort.Strings(topics)
	return topics, total, nil
}

// windowIDs streams the window's event ids into a sorted set. Ids that are
// not uuids (a text column) are only counted. expected sizes the set up
// front (the count taken just before), sparing the copies of growing it.
func (t *table) windowIDs(ctx context.Context, expected int64, done *atomic.Int64) (*rowSet, int64, error) {
	rows, err := t.conn.Query(ctx, "SELECT "+t.idColumn+"::text FROM "+t.outbox+t.inWindow, t.cfg.Since, t.cfg.Until)
	if err != nil {
		return nil, 0, fmt.Errorf("read the window's rows: %w", err)
	}
	defer rows.Close()
	set := &rowSet{ids: make([]EventID, 0, expected)}
	var unchecked int64
	for rows.Next() {
		id, ok := ParseEventID(rows.RawValues()[0])
		if ok {
			set.add(id)
		} else {
			unchecked++
		}
		done.Add(1)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("read the window's rows: %w", err)
	}
	set.seal()
	return set, unchecked, nil
}

// oldestRow is the insert time of the table's oldest row, zero when empty.
func (t *table) oldestRow(ctx context.Context) (time.Time, error) {
	var oldest *time.Time
	if err := t.conn.QueryRow(ctx, "SELECT min("+t.createdColumn+") FROM "+t.outbox).Scan(&oldest); err != nil {
		return time.Time{}, fmt.Errorf("read the oldest row: %w", err)
	}
	if oldest == nil {
		return time.Time{}, nil
	}
	return *oldest, nil
}

// present returns which of ids a table holds in its quoted column
// idColumn, looked up in batches; a non-empty condition narrows the rows
// that count.
func (t *table) present(ctx context.Context, tableName, idColumn, condition, idType string, ids []EventID) (sortedIDs, error) {
	if condition != "" {
		condition += " AND "
	}
	var found sortedIDs
	text := make([]string, 0, min(len(ids), lookupBatch))
	for start := 0; start < len(ids); start += lookupBatch {
		text = text[:0]
		for _, id := range ids[start:min(start+lookupBatch, len(ids))] {
			text = append(text, id.String())
		}
		rows, err := t.conn.Query(ctx, fmt.Sprintf("SELECT %[1]s::text FROM %[2]s WHERE %[3]s%[1]s = ANY($1::text[]::%[4]s[])", idColumn, tableName, condition, idType), text)
		if err != nil {
			return nil, fmt.Errorf("look up event ids in %s: %w", tableName, err)
		}
		for rows.Next() {
			if id, ok := ParseEventID(rows.RawValues()[0]); ok {
				found = append(found, id)
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("look up event ids in %s: %w", tableName, err)
		}
	}
	slices.SortFunc(found, compareIDs)
	return found, nil
}

// phantoms keeps the candidates whose event_id has no row anywhere in the
// table: a record of a row just outside the window is not a phantom.
func (t *table) phantoms(ctx context.Context, candidates []Phantom) ([]Phantom, error) {
	ids := make([]EventID, len(candidates))
	for i := range candidates {
		ids[i] = candidates[i].EventID
	}
	slices.SortFunc(ids, compareIDs)
	ids = slices.Compact(ids)
	found, err := t.present(ctx, t.outbox, t.idColumn, "", t.idType, ids)
	if err != nil {
		return nil, err
	}
	var out []Phantom
	for _, c := range candidates {
		if !found.has(c.EventID) {
			out = append(out, c)
		}
	}
	slices.SortFunc(out, func(a, b Phantom) int {
		if c := strings.Compare(a.Topic, b.Topic); c != 0 {
			return c
		}
		if a.Partition != b.Partition {
			return int(a.Partition - b.Partition)
		}
		return int(a.Offset - b.Offset)
	})
	return out, nil
}

// replayedTopics are the topics `quarantine replay` delivered window rows
// to: a fixed event may go to another topic than its row routes to.
func (t *table) replayedTopics(ctx context.Context) ([]string, error) {
	if !t.replayedColumns {
		return nil, nil
	}
	rows, err := t.conn.Query(ctx, "SELECT DISTINCT q.replayed_topic FROM "+t.quarantine+" q JOIN "+t.outbox+
		" o ON o."+t.idColumn+"::text = q.event_id::text WHERE q.replayed_at IS NOT NULL AND o."+t.createdColumn+" >= $1 AND o."+t.createdColumn+" < $2",
		t.cfg.Since, t.cfg.Until)
	if err != nil {
		return nil, fmt.Errorf("read the topics replay delivered to: %w", err)
	}
	topics, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read the topics replay delivered to: %w", err)
	}
	return topics, nil
}

// splitQuarantined separates the rows the quarantine table holds: those
// waiting for a replay, and those replay delivered (whose records were not
// read back: retention, or a topic since deleted).
func (t *table) splitQuarantined(ctx context.Context, absent sortedIDs) (missing, quarantined, replayed []EventID, err error) {
	if t.quarantine == "" || len(absent) == 0 {
		return absent, nil, nil, nil
	}
	held, err := t.present(ctx, t.quarantine, "event_id", "", "uuid", absent)
	if err != nil {
		return nil, nil, nil, err
	}
	var delivered sortedIDs
	if t.replayedColumns {
		if delivered, err = t.present(ctx, t.quarantine, "event_id", "replayed_at IS NOT NULL", "uuid", held); err != nil {
			return nil, nil, nil, err
		}
	}
	for _, id := range absent {
		switch {
		case delivered.has(id):
			replayed = append(replayed, id)
		case held.has(id):
			quarantined = append(quarantined, id)
		default:
			missing = append(missing, id)
		}
	}
	return missing, quarantined, replayed, nil
}

// rowOrder is the ORDER BY that hands over the window's rows oldest
// first, so events of one aggregate go out in the order they were written.
// The table's insertion number (store.OrderColumn) says it; the event id is
// random and says nothing. Rows from before the table had that column, and
// a table without it, fall back to created_at (the transaction's start),
// the statement that inserted each row (cmin) and its place in the table
// (ctid). Within one transaction that fallback is not sure: WAL replay sets
// every row's cmin to 0, so on a promoted standby only ctid is left, and
// ctid follows free space, so a small row can land on a page before a
// larger one inserted just ahead of it.
func (t *table) rowOrder(ctx context.Context) (string, error) {
	var numbered bool
	if err := t.conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped)`, t.outbox, store.OrderColumn).Scan(&numbered); err != nil {
		return "", fmt.Errorf("look up %s.%s: %w", t.outbox, store.OrderColumn, err)
	}
	fallback := t.createdColumn + ", cmin::text::bigint, ctid, " + t.idColumn
	if !numbered {
		return fallback, nil
	}
	// Rows without a number are older than every numbered one: migrate
	// added the column under a lock that waited for their transactions.
	return quote(store.OrderColumn) + " NULLS FIRST, " + fallback, nil
}

// eachWindowRow streams the window's rows whole, oldest first.
func (t *table) eachWindowRow(ctx context.Context, fn func(ev *event.Event) error) error {
	columns, payloadBinary, err := store.EventColumns(ctx, t.conn, t.outboxName, t.layout, "")
	if err != nil {
		return err
	}
	rows, err := t.conn.Query(ctx, "SELECT "+columns+" FROM "+t.outbox+t.inWindow+" ORDER BY "+t.order,
		t.cfg.Since, t.cfg.Until)
	if err != nil {
		return fmt.Errorf("read the window's rows: %w", err)
	}
	defer rows.Close()
	var ev event.Event
	for rows.Next() {
		ev = event.OfColumns(t.layout, rows.RawValues())
		ev.PayloadBinary = payloadBinary
		if err := fn(&ev); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read the window's rows: %w", err)
	}
	return nil
}
