// Package outbox writes events into the relay's outbox table inside the
// caller's own database transaction, so an event exists exactly when the
// business change it describes does.
//
// The writer enforces the contract the relay reads (the table migrate
// creates, the columns the relay publishes, the header rules), so an event
// the relay could not publish fails here, in the service, with an error that
// names the event and the field, instead of being quarantined later.
//
// Event IDs are stable: the caller's own ID when it has one (derive it from
// the request, so the service's retries keep it), otherwise a time-ordered
// UUID (version 7), which keeps the primary-key index compact.
//
// Many events go to the table in one statement per 1,000 events, not one
// round trip each.
//
// When the ctx of a write carries an OpenTelemetry span, each event gets
// the span's W3C traceparent (and tracestate) headers, so the relay and
// the consumer's inbox continue the request's trace; an event that sets
// traceparent itself keeps its own. The writer only reads the span: it
// needs no tracer provider.
package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/internal/pgname"
)

// DefaultTable is the outbox table migrate creates.
const DefaultTable = "public.outbox_events"

// VersionHeader is the Kafka header that carries Event.AggregateVersion.
// The writer puts it into the row's headers column, which the relay sends
// as headers, so the relay and the table need nothing else.
const VersionHeader = "aggregate_version"

// reservedHeaders are the headers every record carries already; a row's
// own headers may not use them. The list is the relay's
// (event.ReservedHeaders, checked by a test) and the table's CHECK.
var reservedHeaders = []string{"event_id", "event_type", "aggregate_type", "aggregate_id", "schema_version", "occurred_at"}

// contentTypeHeader carries Event.ContentType, in the row's headers.
const contentTypeHeader = "content-type"

// maxRowsPerStatement keeps a statement far below PostgreSQL's 65,535
// parameters (8 per row, 9 for an Emitter) and its plan small.
const maxRowsPerStatement = 1000

// Event is one event to write.
type Event struct {
	// ID is the event_id, a UUID. Leave it empty to get a new UUIDv7; set
	// it (for example a UUID derived from the request's idempotency key)
	// when a retry of the same request must produce the same event.
	ID string
	// AggregateType, AggregateID and EventType are required. AggregateID
	// is the Kafka key: events of one aggregate keep their order.
	AggregateType string
	AggregateID   string
	EventType     string
	// SchemaVersion is the payload's schema version; 0 means 1.
	SchemaVersion int
	// Payload is the record's value: a JSON document, or with ContentType
	// any bytes.
	Payload []byte
	// ContentType, when set, is the payload's media type (for example
	// application/x-protobuf) and makes Payload raw bytes, stored as they
	// are in a bytea payload column (or, by an Emitter, in the message's
	// payload_base64) and not checked as JSON. It travels as the record's
	// content-type header, through the row's headers. Leave it empty for
	// JSON, which is checked. The CloudEvents record formats refuse a
	// row's content-type header: with them, leave ContentType empty, give
	// the bytes with RawPayload, and set the relay's --content-type.
	ContentType string
	// RawPayload makes Payload raw bytes, as ContentType does, without a
	// content-type header of the row's own.
	RawPayload bool
	// Headers are extra Kafka headers (tenant, ...). The relay's own
	// header names and VersionHeader are refused. When the ctx given to
	// Write carries a valid span context, the event gets its W3C
	// traceparent (and tracestate, when not empty) headers, unless
	// Headers sets traceparent itself.
	Headers map[string]string
	// OccurredAt is when the business fact happened; zero means the
	// transaction's start (now()).
	OccurredAt time.Time
	// AggregateVersion, when above 0, is the aggregate's version after
	// this event. It travels as the aggregate_version header, so a
	// consumer can ignore an old version and notice a missing one (see
	// package inbox). Versions of one aggregate must grow by one per event.
	AggregateVersion int64
}

// Writer writes events into one outbox table. It holds no connection and
// is safe for concurrent use.
type Writer struct {
	table string // quoted, schema-qualified
	name  string // as the caller wrote it, for errors
}

// New returns a writer for the outbox table "schema.table" (schema defaults
// to public); an empty name means DefaultTable. The name is read as the
// relay's --table is: a part in double quotes may hold a dot ("S"."a.b"),
// and every part is taken as written, case included.
func New(table string) (*Writer, error) {
	if table == "" {
		table = DefaultTable
	}
	parts, ok := pgname.Split(table)
	if ok && len(parts) == 1 {
		parts = []string{"public", parts[0]}
	}
	if !ok || len(parts) != 2 {
		return nil, fmt.Errorf("outbox table %q: want schema.table, e.g. %s, with a part in double quotes when it holds a dot", table, DefaultTable)
	}
	for _, p := range parts {
		if p == "" || len(p) > 63 || strings.ContainsRune(p, 0) {
			return nil, fmt.Errorf("outbox table %q: each part must be 1 to 63 bytes with no NUL byte", table)
		}
	}
	return &Writer{table: pgx.Identifier(parts).Sanitize(), name: table}, nil
}

// Write inserts the events into the outbox table within tx, in the order
// given, and returns their event IDs. Nothing is written unless every
// event is valid. Commit or roll back tx as usual: the events share its
// fate.
func (w *Writer) Write(ctx context.Context, tx pgx.Tx, events ...Event) ([]string, error) {
	return w.write(ctx, events, func(ctx context.Context, query string, args []any) error {
		_, err := tx.Exec(ctx, query, args...)
		return err
	})
}

// WriteSQL is Write for a database/sql transaction (with the pgx stdlib
// driver or lib/pq).
func (w *Writer) WriteSQL(ctx context.Context, tx *sql.Tx, events ...Event) ([]string, error) {
	return w.write(ctx, events, func(ctx context.Context, query string, args []any) error {
		_, err := tx.ExecContext(ctx, query, args...)
		return err
	})
}

type execFunc func(ctx context.Context, query string, args []any) error

func (w *Writer) write(ctx context.Context, events []Event, exec execFunc) ([]string, error) {
	return writeEvents(ctx, events, exec, w.insert, func(n int) string { return fmt.Sprintf("insert %d events into %s", n, w.name) })
}

// writeEvents checks every event, then runs one statement per chunk of
// them; what says what a failed statement of n events did.
func writeEvents(ctx context.Context, events []Event, exec execFunc, statement func([]row) (string, []any), what func(n int) string) ([]string, error) {
	rows := make([]row, len(events))
	ids := make([]string, len(events))
	tc := traceContextOf(ctx)
	seen := make(map[string]int, len(events))
	for i := range events {
		r, err := prepare(&events[i], tc)
		if err != nil {
			return nil, fmt.Errorf("outbox event %d of %d: %w", i+1, len(events), err)
		}
		if j, dup := seen[r.id]; dup {
			// The second insert would fail on the table's key and abort
			// the whole transaction.
			return nil, fmt.Errorf("outbox event %d of %d: it and event %d have one ID, %s: give each event its own", i+1, len(events), j+1, r.id)
		}
		seen[r.id] = i
		rows[i], ids[i] = r, r.id
	}
	for start := 0; start < len(rows); start += maxRowsPerStatement {
		chunk := rows[start:min(start+maxRowsPerStatement, len(rows))]
		query, args := statement(chunk)
		if err := exec(ctx, query, args); err != nil {
			return nil, fmt.Errorf("%s: %w", what(len(chunk)), err)
		}
	}
	return ids, nil
}

// row is an event ready for the INSERT.
type row struct {
	id            string
	aggregateType string
	aggregateID   string
	eventType     string
	schemaVersion int
	// payload is the JSON text, or for a raw payload its bytes.
	payload    any
	headers    *string
	occurredAt *time.Time
	// raw says payload is bytes, not JSON.
	raw bool
}

// columns of the INSERT, in order; the optional ones are sent only when an
// event of the statement sets them, so a table without them works too.
const insertPrefix = "event_id, aggregate_type, aggregate_id, event_type, payload"

// insert builds one multi-row INSERT. Parameters take their types from
// the table's columns, so uuid or text ids, jsonb or json payloads and
// either timestamp type all work.
func (w *Writer) insert(rows []row) (string, []any) {
	var withVersion, withHeaders, withTime bool
	for _, r := range rows {
		withVersion = withVersion || r.schemaVersion != 1
		withHeaders = withHeaders || r.headers != nil
		withTime = withTime || r.occurredAt != nil
	}
	var b strings.Builder
	b.WriteString("INSERT INTO ")
	b.WriteString(w.table)
	b.WriteString(" (" + insertPrefix)
	if withVersion {
		b.WriteString(", schema_version")
	}
	if withHeaders {
		b.WriteString(", headers")
	}
	if withTime {
		b.WriteString(", occurred_at")
	}
	b.WriteString(") VALUES ")
	args := make([]any, 0, len(rows)*8)
	param := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	for i, r := range rows {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('(')
		b.WriteString(param(r.id) + "," + param(r.aggregateType) + "," + param(r.aggregateID) + "," +
			param(r.eventType) + "," + param(r.payload))
		if withVersion {
			b.WriteString("," + param(r.schemaVersion))
		}
		if withHeaders {
			b.WriteString("," + param(r.headers))
		}
		if withTime {
			if r.occurredAt == nil {
				b.WriteString(",DEFAULT")
			} else {
				b.WriteString("," + param(*r.occurredAt))
			}
		}
		b.WriteByte(')')
	}
	return b.String(), args
}

// Trace context headers (W3C Trace Context), which the relay and package
// inbox read.
const (
	traceparentHeader = "traceparent"
	tracestateHeader  = "tracestate"
)

// traceContext is the W3C headers of the caller's span, empty without one.
type traceContext struct{ traceparent, tracestate string }

// traceContextOf reads ctx's span context through the W3C propagator, so
// the header is what every OpenTelemetry consumer parses, without the
// caller having configured a global propagator.
func traceContextOf(ctx context.Context) traceContext {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return traceContext{}
	}
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, carrier)
	return traceContext{traceparent: carrier[traceparentHeader], tracestate: carrier[tracestateHeader]}
}

// prepare checks an event against the relay's rules and fills in what the
// caller left to the writer: the ID, and tc's headers unless the event
// sets its own traceparent.
func prepare(ev *Event, tc traceContext) (row, error) {
	id := ev.ID
	if id == "" {
		id = NewID()
	} else if !isUUID(id) {
		return row{}, fmt.Errorf("event ID %q is not a UUID (the outbox table's event_id is uuid)", id)
	} else {
		// PostgreSQL prints uuids in lower case, and the relay publishes
		// that text: the returned ID must match the event_id header.
		id = strings.ToLower(id)
	}
	r := row{id: id, aggregateType: ev.AggregateType, aggregateID: ev.AggregateID, eventType: ev.EventType, schemaVersion: ev.SchemaVersion}
	for _, f := range [...]struct{ name, value string }{
		{"AggregateType", ev.AggregateType}, {"AggregateID", ev.AggregateID}, {"EventType", ev.EventType},
	} {
		if f.value == "" {
			return row{}, fmt.Errorf("event %s: %s is empty; the relay needs it for the topic, key and headers", id, f.name)
		}
		if strings.ContainsRune(f.value, 0) {
			return row{}, fmt.Errorf("event %s: %s holds a NUL byte, which PostgreSQL text cannot store", id, f.name)
		}
		if !utf8.ValidString(f.value) {
			return row{}, fmt.Errorf("event %s: %s is not UTF-8 at byte %d, which PostgreSQL text cannot store (it would abort the whole transaction)",
				id, f.name, invalidUTF8At([]byte(f.value)))
		}
	}
	if r.schemaVersion == 0 {
		r.schemaVersion = 1
	}
	if r.schemaVersion < 0 {
		return row{}, fmt.Errorf("event %s: SchemaVersion %d is negative", id, ev.SchemaVersion)
	}
	if r.schemaVersion > math.MaxInt32 {
		return row{}, fmt.Errorf("event %s: SchemaVersion %d is past the column's int range (at most %d)", id, ev.SchemaVersion, math.MaxInt32)
	}
	raw := ev.ContentType != "" || ev.RawPayload
	switch {
	case raw:
		// Not nil: an empty payload is a payload, NULL none.
		r.payload, r.raw = append([]byte{}, ev.Payload...), true
	case len(ev.Payload) == 0 || !json.Valid(ev.Payload):
		return row{}, fmt.Errorf("event %s: Payload is not a JSON document (the relay publishes the payload column, jsonb); for bytes, set ContentType", id)
	case !utf8.Valid(ev.Payload):
		// encoding/json accepts any byte inside a string; PostgreSQL
		// does not, and would abort the whole transaction.
		return row{}, fmt.Errorf("event %s: Payload is not UTF-8 at byte %d, which a JSON payload column cannot store (PostgreSQL would abort the whole transaction); "+
			"fix the text, or for bytes set ContentType", id, invalidUTF8At(ev.Payload))
	default:
		if at, esc := badEscape(ev.Payload); at >= 0 && esc == `\u0000` {
			return row{}, fmt.Errorf("event %s: Payload holds the escape \\u0000 at byte %d, which jsonb cannot store (PostgreSQL would abort the whole transaction); drop the NUL character or encode it another way", id, at)
		} else if at >= 0 {
			return row{}, fmt.Errorf("event %s: Payload holds the escape %s at byte %d, a lone surrogate (half of a UTF-16 pair without its other half), which is no character "+
				"and which jsonb refuses (PostgreSQL would abort the whole transaction); fix the encoder that wrote it", id, esc, at)
		}
		if err := checkJSON(ev.Payload); err != nil {
			return row{}, fmt.Errorf("event %s: Payload: %w", id, err)
		}
		r.payload = string(ev.Payload)
	}
	if ev.AggregateVersion < 0 {
		return row{}, fmt.Errorf("event %s: AggregateVersion %d is negative", id, ev.AggregateVersion)
	}
	if len(ev.Headers) > 0 || ev.AggregateVersion > 0 || ev.ContentType != "" || tc.traceparent != "" {
		headers := make(map[string]string, len(ev.Headers)+4)
		for k, v := range ev.Headers {
			if err := checkHeader(k, v); err != nil {
				return row{}, fmt.Errorf("event %s: %w", id, err)
			}
			headers[k] = v
		}
		if ev.ContentType != "" {
			if _, ok := headers[contentTypeHeader]; ok {
				return row{}, fmt.Errorf("event %s: both ContentType and Headers set %s; set one", id, contentTypeHeader)
			}
			if err := checkHeader(contentTypeHeader, ev.ContentType); err != nil {
				return row{}, fmt.Errorf("event %s: ContentType: %w", id, err)
			}
			headers[contentTypeHeader] = ev.ContentType
		}
		if _, own := headers[traceparentHeader]; !own && tc.traceparent != "" {
			// The pair goes together: a tracestate belongs to the
			// traceparent it came with.
			headers[traceparentHeader] = tc.traceparent
			if _, own := headers[tracestateHeader]; !own && tc.tracestate != "" {
				headers[tracestateHeader] = tc.tracestate
			}
		}
		if ev.AggregateVersion > 0 {
			headers[VersionHeader] = strconv.FormatInt(ev.AggregateVersion, 10)
		}
		b, err := json.Marshal(headers)
		if err != nil {
			return row{}, fmt.Errorf("event %s: encode headers: %w", id, err)
		}
		s := string(b)
		r.headers = &s
	}
	if !ev.OccurredAt.IsZero() {
		t := ev.OccurredAt
		// timestamptz runs from 4713 BC to 294276 AD.
		if y := t.UTC().Year(); y < -4712 || y > 294275 {
			return row{}, fmt.Errorf("event %s: OccurredAt %s is outside what PostgreSQL's timestamptz holds (4713 BC to 294276 AD)", id, t.UTC().Format("2006-01-02"))
		}
		r.occurredAt = &t
	}
	return r, nil
}

// badEscape returns the offset and text of the first escape in the valid
// JSON document doc that jsonb refuses: \u0000, or a lone surrogate (a
// high one not followed by a low one, or a low one alone); -1 if none. In
// valid JSON a backslash appears only inside a string and always starts an
// escape, so skipping each escape's second byte tells `\u0000` from an
// escaped backslash followed by "u0000".
func badEscape(doc []byte) (int, string) {
	unicode := func(i int) (rune, bool) {
		if i+6 > len(doc) || doc[i] != '\\' || doc[i+1] != 'u' {
			return 0, false
		}
		n, err := strconv.ParseUint(string(doc[i+2:i+6]), 16, 16)
		return rune(n), err == nil
	}
	for i := 0; i < len(doc)-1; i++ {
		if doc[i] != '\\' {
			continue
		}
		r, ok := unicode(i)
		if !ok {
			i++
			continue
		}
		switch {
		case r == 0:
			return i, string(doc[i : i+6])
		case utf16.IsSurrogate(r) && r < 0xdc00:
			if low, ok := unicode(i + 6); ok && low >= 0xdc00 && low <= 0xdfff {
				i += 11
				continue
			}
			return i, string(doc[i : i+6])
		case utf16.IsSurrogate(r):
			return i, string(doc[i : i+6])
		}
		i += 5
	}
	return -1, ""
}

// invalidUTF8At returns the offset of the first byte of b that is not
// part of valid UTF-8.
func invalidUTF8At(b []byte) int {
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError && n == 1 {
			return i
		}
		i += n
	}
	return len(b)
}

// errReserved says which header a row may not set.
var errReserved = errors.New("is set by the relay for every record and may not be a row header")

func checkHeader(name, value string) error {
	for _, r := range reservedHeaders {
		if name == r {
			return fmt.Errorf("header %q %w", name, errReserved)
		}
	}
	if name == VersionHeader {
		return fmt.Errorf("header %q is written from Event.AggregateVersion; set that instead", name)
	}
	if strings.ContainsRune(name, 0) || strings.ContainsRune(value, 0) {
		return fmt.Errorf("header %q holds a NUL byte, which jsonb cannot store", name)
	}
	// encoding/json would turn such bytes into U+FFFD without a word.
	if !utf8.ValidString(name) || !utf8.ValidString(value) {
		return fmt.Errorf("header %q is not UTF-8 (name or value), which the headers column (jsonb) cannot store; "+
			"encode binary values as text (base64, hex)", strings.ToValidUTF8(name, "\uFFFD"))
	}
	return nil
}
