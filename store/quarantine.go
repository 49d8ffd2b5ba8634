package store

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pg"
)

// Quarantined is one event Kafka would not accept, as it is kept in the
// quarantine table. Text fields hold PostgreSQL's text forms.
type Quarantined struct {
	event.Stored
	Topic         string    `json:"topic"`
	ErrorClass    string    `json:"error_class"`
	ErrorMessage  string    `json:"error_message"`
	Attempts      int       `json:"attempts"`
	FirstFailedAt time.Time `json:"first_failed_at"`
	LastFailedAt  time.Time `json:"last_failed_at"`
	// ReplayedAt is when Kafka acknowledged the event's replay to
	// ReplayedTopic; nil while it waits for one.
	ReplayedAt    *time.Time `json:"replayed_at,omitempty"`
	ReplayedTopic string     `json:"replayed_topic,omitempty"`

	// ContentProblem says why the row's typed fields are not the event as
	// it arrived: a logical decoding message's content that is no event
	// (the decoder's reason), or values PostgreSQL refused as text or
	// jsonb, which Put stores escaped or as placeholders (it says which).
	// `quarantine replay` refuses a row while it is set; the operator
	// fixes the typed columns and clears it. Empty for an event whose
	// typed fields are what it was.
	ContentProblem string `json:"content_problem,omitempty"`
	// Raw is the content exactly as it arrived: a message's content, as
	// the relay read it from the WAL. Put stores it when ContentProblem is
	// set or the typed fields cannot be stored as they are (when Raw is
	// then nil, Put keeps the event's fields as JSON instead). JSON shows
	// it base64.
	Raw []byte `json:"raw,omitempty"`
	// RawSize and RawSHA256 describe the content: its length in bytes and
	// its SHA-256. Put fills them whenever it stores Raw.
	//
	// A content too large to keep, never held in memory, is quarantined
	// by reference: Raw nil, RawSize its length (> 0), RawSHA256 its
	// digest (32 bytes), RawLSN the WAL position of its message, EventID
	// an ID derived from that position (messages.DerivedEventID), the
	// other typed fields empty, Payload empty (stored as NULL), and
	// ErrorClass and ErrorMessage saying why, as for any quarantined
	// event. ContentProblem may be left empty: Put then says the content
	// was kept by reference. Such a row is never replayed; the writer
	// emits the event again.
	RawSize   int64  `json:"raw_size,omitempty"`
	RawSHA256 []byte `json:"-"`
	// RawLSN is the WAL position of the message the content came in, or
	// of the table's row whose values the relay dropped for their size;
	// 0 for any other row.
	RawLSN lsn.LSN `json:"-"`

	// occurredAt is OccurredAt as a time, for JSON; OccurredAt keeps
	// PostgreSQL's text, which a replay sends in the header as run does.
	occurredAt *time.Time
}

// MarshalJSON writes every time as RFC 3339 in UTC, like the relay's other
// JSON, occurred_at included.
func (e Quarantined) MarshalJSON() ([]byte, error) {
	type plain Quarantined // without this method
	p := plain(e)
	p.FirstFailedAt, p.LastFailedAt = p.FirstFailedAt.UTC(), p.LastFailedAt.UTC()
	if p.ReplayedAt != nil {
		replayed := p.ReplayedAt.UTC()
		p.ReplayedAt = &replayed
	}
	if e.occurredAt != nil {
		p.OccurredAt = e.occurredAt.UTC().Format(time.RFC3339Nano)
	}
	// A digest and a WAL position read as they do everywhere else.
	var extra struct {
		plain
		RawSHA256 string `json:"raw_sha256,omitempty"`
		RawLSN    string `json:"raw_lsn,omitempty"`
	}
	extra.plain = p
	if e.RawSHA256 != nil {
		extra.RawSHA256 = hex.EncodeToString(e.RawSHA256)
	}
	if e.RawLSN != 0 {
		extra.RawLSN = e.RawLSN.String()
	}
	return json.Marshal(extra)
}

// Access is what a caller does with the quarantine table; Open checks the
// role holds the privileges it needs before anything depends on them.
type Access int

const (
	// ForRelay stores events and counts them (run).
	ForRelay Access = iota
	// ForList reads them (quarantine list, the metrics poller).
	ForList
	// ForReplay reads them and marks them replayed (quarantine replay).
	ForReplay
)

func (a Access) privileges() []string {
	switch a {
	case ForRelay:
		// INSERT ... ON CONFLICT DO UPDATE reads the row it updates.
		return []string{"SELECT", "INSERT", "UPDATE"}
	case ForReplay:
		return []string{"SELECT", "UPDATE"}
	}
	return []string{"SELECT"}
}

// Quarantine reads and writes the quarantine table. It is safe for
// concurrent use: the read loop and the producer's outcome goroutine both
// quarantine events.
type Quarantine struct {
	mu    sync.Mutex
	conn  *pgx.Conn
	table Table
	// payloadCast is the cast Put applies to the payload: none for a text
	// column, which takes any payload the outbox holds.
	payloadCast string
	// replayedColumns is whether the table has replayed_at and
	// replayed_topic; a table from before them holds no replayed event.
	replayedColumns bool
	// payloadBytes is whether the table has payload_bytes, where a binary
	// payload is kept; a table from before it holds none.
	payloadBytes bool
	// rawColumns is whether the table has raw and content_problem
	// (migration 006); a table from before them holds no such row.
	rawColumns bool
}

// OpenQuarantine connects to the database and checks the quarantine table
// exists, the role may use it as access needs, and (for ForRelay) that it
// can hold every payload the outbox table can.
func OpenQuarantine(ctx context.Context, cfg pg.Config, table Table, access Access) (*Quarantine, error) {
	conn, err := pg.Dial(ctx, cfg)
	if err != nil {
		return nil, err
	}
	q := &Quarantine{conn: conn, table: table}
	if err := q.check(ctx, cfg, access); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	return q, nil
}

func (q *Quarantine) check(ctx context.Context, cfg pg.Config, access Access) error {
	quoted := q.table.Quoted()
	if err := pg.RequireSchemaUsage(ctx, q.conn, q.table.Schema); err != nil {
		return err
	}
	var exists bool
	if err := q.conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", quoted).Scan(&exists); err != nil {
		return fmt.Errorf("look up quarantine table: %w", err)
	}
	if !exists {
		advice := "run `outbox-relay migrate`, or fix --quarantine-table"
		if access == ForRelay {
			advice = "run `outbox-relay migrate`, or use --on-permanent-error halt"
		}
		return fmt.Errorf("%w: quarantine table %s does not exist: %s", pg.ErrPrecondition, quoted, advice)
	}
	var role string
	var missing []string
	for _, priv := range access.privileges() {
		var ok bool
		if err := q.conn.QueryRow(ctx, "SELECT current_user, has_table_privilege($1, $2)", quoted, priv).Scan(&role, &ok); err != nil {
			return fmt.Errorf("check privileges on quarantine table: %w", err)
		}
		if !ok {
			missing = append(missing, priv)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: role %q lacks %s on the quarantine table %s: run GRANT %s ON %s TO %s; as the table's owner",
			pg.ErrPrecondition, role, strings.Join(missing, ", "), quoted,
			strings.Join(access.privileges(), ", "), quoted, pgx.Identifier{role}.Sanitize())
	}
	replayedAt, err := q.columnType(ctx, quoted, "replayed_at")
	if err != nil {
		return err
	}
	q.replayedColumns = replayedAt != ""
	payloadBytes, err := q.columnType(ctx, quoted, "payload_bytes")
	if err != nil {
		return err
	}
	q.payloadBytes = payloadBytes == "bytea"
	problem, err := q.columnType(ctx, quoted, "content_problem")
	if err != nil {
		return err
	}
	q.rawColumns = problem != ""
	if access == ForReplay && !q.replayedColumns {
		return fmt.Errorf("%w: the quarantine table %s has no column replayed_at, where replay records what it delivered: run `outbox-relay migrate` to add it",
			pg.ErrPrecondition, quoted)
	}
	if access != ForRelay {
		return nil
	}
	if !q.rawColumns {
		// Refused, not degraded: without them an event whose content
		// PostgreSQL cannot store as text would stop the relay at every
		// start, and a writer could emit one at any time.
		return fmt.Errorf("%w: the quarantine table %s has no columns raw and content_problem, where the relay keeps a content PostgreSQL cannot store as text: run `outbox-relay migrate` to add them",
			pg.ErrPrecondition, quoted)
	}
	outbox, err := ParseTable("--table", cfg.Table)
	if err != nil {
		return err
	}
	// The quarantine table keeps the relay's own column names whatever the
	// outbox table's layout.
	l := cfg.OutboxLayout()
	for _, c := range []struct {
		column string
		field  layout.Field
	}{{"event_id", layout.EventID}, {"payload", layout.Payload}} {
		column := c.column
		stored, err := q.columnType(ctx, quoted, column)
		if err != nil {
			return err
		}
		if column == "payload" && (stored == "jsonb" || stored == "json") {
			q.payloadCast = "::" + stored
		}
		source, err := q.columnType(ctx, outbox.Quoted(), l.Column(c.field))
		if err != nil {
			return err
		}
		if source == "bytea" && c.field == layout.Payload {
			if !q.payloadBytes {
				// Binary events could then not be quarantined, and the
				// relay would stall on the first.
				return fmt.Errorf("%w: the outbox table's %s is bytea but the quarantine table %s has no column payload_bytes to keep such payloads: run `outbox-relay migrate` to add it",
					pg.ErrPrecondition, l.Column(c.field), quoted)
			}
			continue
		}
		if isText(source) && !isText(stored) {
			// A text value need not be a uuid or JSON, and one that is not
			// would fail the insert: the event could then be neither
			// published nor quarantined, and the relay would stall.
			return fmt.Errorf("%w: the outbox table's %s is %s but the quarantine table %s stores it as %s, so some events could not be quarantined: run ALTER TABLE %s ALTER COLUMN %s TYPE text;",
				pg.ErrPrecondition, l.Column(c.field), source, quoted, stored, quoted, column)
		}
	}
	if l.PayloadNullable() {
		var payloadNotNull bool
		if err := q.conn.QueryRow(ctx, "SELECT attnotnull FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'payload' AND NOT attisdropped",
			quoted).Scan(&payloadNotNull); err != nil {
			return fmt.Errorf("read column payload of %s: %w", quoted, err)
		}
		if payloadNotNull {
			// An event with a NULL payload could then not be quarantined,
			// and the relay would stall on it.
			return fmt.Errorf("%w: the quarantine table %s cannot hold a NULL payload, which --outbox-layout %s publishes as a null value: run `outbox-relay migrate` to allow it",
				pg.ErrPrecondition, quoted, l.Name())
		}
	}
	return nil
}

func isText(typ string) bool { return typ == "text" || typ == "character varying" }

// columnType returns the base type of a table's column, "" when the table
// has no such column.
func (q *Quarantine) columnType(ctx context.Context, quotedTable, column string) (string, error) {
	var typ string
	err := q.conn.QueryRow(ctx, `
		SELECT format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END, NULL)
		FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
		WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped`, quotedTable, column).Scan(&typ)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read column %s of %s: %w", column, quotedTable, err)
	}
	return typ, nil
}

// Table is the quarantine table's name.
func (q *Quarantine) Table() Table { return q.table }

// Close closes the connection.
func (q *Quarantine) Close() error { return q.conn.Close(context.Background()) }

// Put stores an event, or counts one more attempt of an event already
// there. e.Attempts, when set, is how many attempts the caller made in all
// (poll mode counts them per event), so the table says what the relay's
// log said; zero counts this one attempt. It returns once the row is committed, so the caller may then let
// the slot pass the event. An event already replayed stays replayed: Kafka
// holds it, and this is the original row sent again (a re-stream).
//
// Whatever the event holds, Put stores it: when PostgreSQL refuses a value
// as text or jsonb (a data exception, or a value over a limit), Put stores
// the row again with those values escaped or left out, the original in
// raw, and says which in content_problem and error_message (see
// storable). An error from Put is therefore never the event's content.
func (q *Quarantine) Put(ctx context.Context, e Quarantined) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if e.Raw == nil && e.RawSize > 0 && e.ContentProblem == "" {
		e.ContentProblem = fmt.Sprintf("the content (%d bytes, sha256 %x) was too large to keep; it is not in this table", e.RawSize, e.RawSHA256)
		if e.RawLSN != 0 {
			e.ContentProblem += "; its message is at WAL position " + e.RawLSN.String()
		}
	}
	e.ErrorMessage = textSafe(e.ErrorMessage)
	e.ContentProblem = textSafe(e.ContentProblem)
	raw := e.Raw
	if e.ContentProblem != "" && e.Raw != nil {
		e.RawSize, e.RawSHA256 = digest(e.Raw)
		if len(e.Raw) > rawMax {
			// A statement holds at most 1 GB: keep a reference.
			e.Raw = nil
			e.ContentProblem += fmt.Sprintf("; the content (%d bytes) was too large to keep: raw_size and raw_sha256 describe it", e.RawSize)
		}
	} else if e.RawSize == 0 {
		// The typed fields are the event: raw would only repeat them.
		e.Raw = nil
	}
	err := q.insert(ctx, &e)
	if err == nil || !dataException(err) {
		return err
	}
	refused := err
	for _, whole := range []bool{false, true} {
		fallback, ok := q.storable(e, raw, refused, whole)
		if !ok {
			continue
		}
		if err = q.insert(ctx, &fallback); err == nil || !dataException(err) {
			return err
		}
	}
	return err
}

// insert writes one row, or counts an attempt of the row already there.
// What the first write stored of the content (raw, content_problem) stays:
// a re-stream sends the same content, and an operator may have fixed the
// row since.
func (q *Quarantine) insert(ctx context.Context, e *Quarantined) error {
	headers := &e.Headers
	if e.Headers == "" {
		headers = nil
	}
	occurred := &e.OccurredAt
	if e.OccurredAt == "" {
		occurred = nil
	}
	version := e.SchemaVersion
	if version == "" {
		version = "1"
	}
	var payload *string
	var payloadBytes []byte
	switch {
	case e.PayloadBinary:
		if !q.payloadBytes {
			return fmt.Errorf("quarantine event %s: the quarantine table has no column payload_bytes for its binary payload; run `outbox-relay migrate`", e.EventID)
		}
		b, err := e.PayloadBytes()
		if err != nil {
			return fmt.Errorf("quarantine event %s: %w", e.EventID, err)
		}
		// Not nil: an empty bytea is a payload, NULL none.
		payloadBytes = append([]byte{}, b...)
	case e.PayloadNull:
	case e.Payload == "" && e.RawSize > 0 && e.Raw == nil:
		// Kept by reference: there is no payload here, not a null one.
	case e.Payload == "" && q.payloadCast != "":
		null := "null"
		payload = &null
	default:
		payload = &e.Payload
	}
	args := []any{e.EventID, e.AggregateType, e.AggregateID, e.EventType, version, payload, headers, occurred,
		e.Topic, e.ErrorClass, e.ErrorMessage, e.Attempts}
	columns, values := "", ""
	if q.payloadBytes {
		// Only a table that has the column names it, so one from before
		// binary payloads takes JSON events as it always did.
		columns, values = ", payload_bytes", ", $13::bytea"
		args = append(args, payloadBytes)
	}
	if q.rawColumns {
		var problem, rawLSN *string
		if e.ContentProblem != "" {
			problem = &e.ContentProblem
		}
		if e.RawLSN != 0 {
			s := e.RawLSN.String()
			rawLSN = &s
		}
		var size *int64
		if e.RawSize > 0 {
			size = &e.RawSize
		}
		n := len(args)
		columns += ", raw, raw_size, raw_sha256, raw_lsn, content_problem"
		values += fmt.Sprintf(", $%d::bytea, $%d::bigint, $%d::bytea, $%d::pg_lsn, $%d", n+1, n+2, n+3, n+4, n+5)
		args = append(args, e.Raw, size, e.RawSHA256, rawLSN, problem)
	}
	_, err := q.conn.Exec(ctx, `
		INSERT INTO `+q.table.Quoted()+` AS q (event_id, aggregate_type, aggregate_id, event_type, schema_version, payload, headers,
			occurred_at, topic, error_class, error_message, attempts`+columns+`)
		VALUES ($1, $2, $3, $4, $5::int, $6`+q.payloadCast+`, $7::jsonb, $8::timestamptz, $9, $10, $11, greatest($12::int, 1)`+values+`)
		ON CONFLICT (event_id) DO UPDATE SET attempts = greatest(q.attempts + 1, excluded.attempts), last_failed_at = now(),
			topic = excluded.topic, error_class = excluded.error_class, error_message = excluded.error_message`,
		args...)
	if err != nil {
		return fmt.Errorf("quarantine event %s: %w", e.EventID, err)
	}
	return nil
}

// pending narrows a query to the events not replayed yet.
func (q *Quarantine) pending() string {
	if !q.replayedColumns {
		return ""
	}
	return " WHERE replayed_at IS NULL"
}

// Count returns how many events wait for a replay.
func (q *Quarantine) Count(ctx context.Context) (int64, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	var n int64
	if err := q.conn.QueryRow(ctx, "SELECT count(*) FROM "+q.table.Quoted()+q.pending()).Scan(&n); err != nil {
		return 0, fmt.Errorf("count quarantined events: %w", err)
	}
	return n, nil
}

// Selection is which quarantined events List returns.
type Selection struct {
	// EventID narrows the list to one event, replayed or not.
	EventID string
	// Replayed adds the events replay delivered to those still waiting.
	Replayed bool
}

// List returns quarantined events, oldest first.
func (q *Quarantine) List(ctx context.Context, sel Selection) ([]Quarantined, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	replayed := "NULL::timestamptz, ''"
	if q.replayedColumns {
		replayed = "replayed_at, COALESCE(replayed_topic, '')"
	}
	// A binary payload comes back in bytea's hex text form, whatever the
	// session's bytea_output, as event.Stored keeps it.
	payload := "COALESCE(payload::text, ''), payload IS NULL, false, false"
	if q.payloadBytes {
		payload = `COALESCE(payload::text, '\x' || encode(payload_bytes, 'hex'), ''), payload IS NULL AND payload_bytes IS NULL, payload_bytes IS NOT NULL,
			payload IS NOT NULL AND payload_bytes IS NOT NULL`
	}
	raw := "NULL::bytea, 0::bigint, NULL::bytea, '', ''"
	if q.rawColumns {
		raw = "raw, COALESCE(raw_size, 0), raw_sha256, COALESCE(raw_lsn::text, ''), COALESCE(content_problem, '')"
	}
	query := `SELECT event_id::text, aggregate_type, aggregate_id, event_type, schema_version::text, ` + payload + `,
		COALESCE(headers::text, ''), COALESCE(occurred_at::text, ''), occurred_at, topic, error_class, error_message, attempts,
		first_failed_at, last_failed_at, ` + replayed + `, ` + raw + ` FROM ` + q.table.Quoted()
	var args []any
	switch {
	case sel.EventID != "":
		query += " WHERE event_id::text = $1"
		args = append(args, sel.EventID)
	case !sel.Replayed:
		query += q.pending()
	}
	rows, err := q.conn.Query(ctx, query+" ORDER BY first_failed_at, event_id", args...)
	if err != nil {
		return nil, fmt.Errorf("list quarantined events: %w", err)
	}
	defer rows.Close()
	var out []Quarantined
	for rows.Next() {
		var e Quarantined
		var rawLSN string
		var bothPayloads bool
		if err := rows.Scan(&e.EventID, &e.AggregateType, &e.AggregateID, &e.EventType, &e.SchemaVersion, &e.Payload, &e.PayloadNull, &e.PayloadBinary, &bothPayloads,
			&e.Headers, &e.OccurredAt, &e.occurredAt, &e.Topic, &e.ErrorClass, &e.ErrorMessage, &e.Attempts, &e.FirstFailedAt, &e.LastFailedAt,
			&e.ReplayedAt, &e.ReplayedTopic, &e.Raw, &e.RawSize, &e.RawSHA256, &rawLSN, &e.ContentProblem); err != nil {
			return nil, fmt.Errorf("read quarantined event: %w", err)
		}
		if bothPayloads {
			// A row fixed by hand can hold both; which one is the event's
			// is the operator's call, so a replay must not guess.
			e.ContentProblem = strings.TrimPrefix(e.ContentProblem+"; both payload and payload_bytes are set: set the one that is not the event's payload to NULL", "; ")
		}
		if rawLSN != "" {
			if e.RawLSN, err = lsn.Parse(rawLSN); err != nil {
				return nil, fmt.Errorf("read quarantined event %s: %w", e.EventID, err)
			}
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list quarantined events: %w", err)
	}
	return out, nil
}

// MarkReplayed records that Kafka acknowledged the event's replay to topic;
// call it only after that ack. The row stays, so reconcile knows the event
// was delivered and where.
func (q *Quarantine) MarkReplayed(ctx context.Context, eventID, topic string) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if _, err := q.conn.Exec(ctx, "UPDATE "+q.table.Quoted()+" SET replayed_at = now(), replayed_topic = $2 WHERE event_id::text = $1",
		eventID, topic); err != nil {
		return fmt.Errorf("mark event %s replayed: %w", eventID, err)
	}
	return nil
}
