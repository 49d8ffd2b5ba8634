// Package layout says what the outbox table looks like and what shape the
// records made from it take: which column holds each field, which extra
// columns become headers, and whether records follow the relay's own shape,
// that of Debezium's Outbox Event Router, or CloudEvents' Kafka protocol
// binding (the record format, chosen apart from the table). The pgoutput
// decoder, the column checks, the record builder and every SQL reader of
// the table (reconcile, the quarantine) take one Layout, so a column name
// or a record rule is decided here and nowhere else. It imports nothing of
// the relay's.
package layout

import (
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
)

// Shape is the table's layout: its default columns, which of them are
// required, and the record format its rows make unless --record-format
// picks another.
type Shape uint8

const (
	// ShapeRelay is the relay's own table, whose rows make the relay's own
	// record by default: key aggregate_id, value the payload, six standard
	// headers plus the row's headers column.
	ShapeRelay Shape = iota
	// ShapeDebezium is Debezium's outbox table, whose rows make the record
	// of Debezium's Outbox Event Router with its defaults: key the
	// aggregate id, value the payload (null for a NULL payload), one header
	// "id" with the event id, then the extra header columns.
	ShapeDebezium
)

// Names of the layouts, as --outbox-layout takes them.
const (
	NameRelay    = "relay"
	NameDebezium = "debezium"
)

// Format is the shape of the records, apart from the table they come
// from: what goes in the key, the value and the headers.
type Format uint8

const (
	// FormatDefault is the table layout's own format: FormatRelay for the
	// relay's table, FormatDebezium for Debezium's.
	FormatDefault Format = iota
	// FormatRelay is the relay's own record (see ShapeRelay).
	FormatRelay
	// FormatDebezium is the Outbox Event Router's record (see ShapeDebezium).
	FormatDebezium
	// FormatCloudEvents is a CloudEvent in the Kafka protocol binding's
	// binary content mode: the attributes in ce_ headers, the value the
	// payload.
	FormatCloudEvents
	// FormatCloudEventsStructured is a CloudEvent in the structured content
	// mode: the whole event as JSON in the value.
	FormatCloudEventsStructured
)

// Names of the record formats, as --record-format takes them.
const (
	FormatNameRelay                 = "relay"
	FormatNameDebezium              = "debezium"
	FormatNameCloudEvents           = "cloudevents"
	FormatNameCloudEventsStructured = "cloudevents-structured"
)

var formatNames = [...]string{FormatRelay: FormatNameRelay, FormatDebezium: FormatNameDebezium,
	FormatCloudEvents: FormatNameCloudEvents, FormatCloudEventsStructured: FormatNameCloudEventsStructured}

// String is the format's --record-format value.
func (f Format) String() string {
	if f == FormatDefault || int(f) >= len(formatNames) {
		return "default"
	}
	return formatNames[f]
}

// CloudEvents reports whether the format is one of CloudEvents' modes.
func (f Format) CloudEvents() bool {
	return f == FormatCloudEvents || f == FormatCloudEventsStructured
}

// Field is one value the relay reads from a row.
type Field int

// The fields of a row, in the order Row values, SELECT lists and Columns
// use. CreatedAt is not part of any record: reconcile windows and retention
// select rows by it.
const (
	EventID Field = iota
	AggregateType
	AggregateID
	EventType
	SchemaVersion
	Payload
	Headers
	OccurredAt
	// ContentType is the payload's media type, per row; no layout reads
	// a column for it unless --column-content-type names one.
	ContentType
	// NumFields is how many fields a record is made of.
	NumFields
	CreatedAt  = NumFields
	NumColumns = NumFields + 1
)

// field describes one field: its flag, its column in each shape (empty: not
// read by default), and what the column checks accept.
type field struct {
	flag string
	// columns by Shape.
	columns [2]string
	// required by Shape: the table must have the column.
	required [2]bool
	types    []string // format_type() names of the base type
	// cast is appended to the column in a SELECT list so the value comes
	// in the text form the replication stream delivers.
	cast string
}

var (
	idTypes   = []string{"uuid", "text", "character varying"}
	textTypes = []string{"text", "character varying"}
	timeTypes = []string{"timestamp with time zone", "timestamp without time zone"}
)

var fields = [NumColumns]field{
	EventID:       {"--column-event-id", [2]string{"event_id", "id"}, [2]bool{true, true}, idTypes, "::text"},
	AggregateType: {"--column-aggregate-type", [2]string{"aggregate_type", "aggregatetype"}, [2]bool{true, true}, textTypes, ""},
	AggregateID:   {"--column-aggregate-id", [2]string{"aggregate_id", "aggregateid"}, [2]bool{true, true}, textTypes, ""},
	EventType:     {"--column-event-type", [2]string{"event_type", "type"}, [2]bool{true, false}, textTypes, ""},
	SchemaVersion: {"--column-schema-version", [2]string{"schema_version", ""}, [2]bool{}, []string{"integer", "smallint", "bigint"}, "::text"},
	Payload:       {"--column-payload", [2]string{"payload", "payload"}, [2]bool{true, true}, []string{"jsonb", "json", "text", "bytea"}, "::text"},
	Headers:       {"--column-headers", [2]string{"headers", ""}, [2]bool{}, []string{"jsonb", "json"}, "::text"},
	OccurredAt:    {"--column-occurred-at", [2]string{"occurred_at", ""}, [2]bool{}, timeTypes, "::text"},
	ContentType:   {"--column-content-type", [2]string{"", ""}, [2]bool{}, textTypes, ""},
	CreatedAt:     {"--column-created-at", [2]string{"created_at", "timestamp"}, [2]bool{}, timeTypes, ""},
}

// Flag is the flag that names a field's column.
func Flag(f Field) string { return fields[f].flag }

// HeaderColumn is an extra column whose value becomes a header.
type HeaderColumn struct {
	Column string
	Header string
}

// Layout is the outbox table's columns and the records' shape. The zero
// Layout is the relay's own.
type Layout struct {
	Shape Shape
	// Format is the records' format; FormatDefault is the Shape's own.
	Format Format
	// CloudEventsSource is every CloudEvent's source attribute, a URI
	// reference; set with a CloudEvents format.
	CloudEventsSource string
	// ContentType is the media type of every payload, from
	// --content-type; empty sends none where the format has room not to.
	ContentType string
	// Columns overrides the shape's column names, by Field; empty keeps
	// the shape's default.
	Columns [NumColumns]string
	// HeaderColumns are extra columns placed as headers, in record order.
	HeaderColumns []HeaderColumn
	// headerKeys are the header names as bytes, made once by New so the
	// record builder does not convert them per event.
	headerKeys [][]byte
	// contentType is ContentType as bytes, made by SetContentType.
	contentType []byte
}

// Relay is the relay's own layout; it is never changed.
var Relay = &Layout{}

// New builds a layout from --outbox-layout, the --column-* overrides (by
// Field) and --header-columns ("column" or "column:header", comma-separated),
// checking what can be checked without the table.
func New(name string, columns [NumColumns]string, headerColumns string) (*Layout, error) {
	l := &Layout{Columns: columns}
	switch name {
	case NameRelay, "":
		l.Shape = ShapeRelay
	case NameDebezium:
		l.Shape = ShapeDebezium
	default:
		return nil, fmt.Errorf("--outbox-layout %q: use %s (the relay's own table and records) or %s (a Debezium outbox table, records as its Outbox Event Router makes them)", name, NameRelay, NameDebezium)
	}
	for f := range columns {
		if c := columns[f]; c != "" {
			if err := validColumn(fields[f].flag, c); err != nil {
				return nil, err
			}
		}
	}
	for _, item := range strings.Split(headerColumns, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		column, header, aliased := strings.Cut(item, ":")
		if !aliased {
			header = column
		}
		if err := validColumn("--header-columns", column); err != nil {
			return nil, err
		}
		if header == "" {
			return nil, fmt.Errorf("--header-columns %q: the header name after ':' is empty", item)
		}
		l.HeaderColumns = append(l.HeaderColumns, HeaderColumn{Column: column, Header: header})
	}
	if len(l.HeaderColumns) > 0 && l.Shape != ShapeDebezium {
		return nil, errors.New("--header-columns needs --outbox-layout debezium; in the relay's layout, put extra headers in the headers column")
	}
	seen := map[string]bool{"id": true}
	for _, name := range l.HeaderNames() {
		if seen[name] {
			return nil, fmt.Errorf("--header-columns: header %q appears twice, or is the event id's header \"id\"; give each column its own header name with column:header", name)
		}
		seen[name] = true
		l.headerKeys = append(l.headerKeys, []byte(name))
	}
	return l, nil
}

// SetRecordFormat sets the records' format from --record-format (empty:
// the layout's own) and --cloudevents-source, which a CloudEvents format
// needs and any other refuses, and checks that the layout's header
// columns fit the format. Call it once, on a layout New made.
func (l *Layout) SetRecordFormat(name, source string) error {
	format := FormatDefault
	if name != "" {
		i := slices.Index(formatNames[:], name)
		if i <= int(FormatDefault) {
			return fmt.Errorf("--record-format %q: use %s (the relay's own records), %s (Debezium's Outbox Event Router's), %s (CloudEvents, binary content mode: ce_ headers, the payload as the value) or %s (CloudEvents, structured content mode: the whole event as JSON in the value)",
				name, FormatNameRelay, FormatNameDebezium, FormatNameCloudEvents, FormatNameCloudEventsStructured)
		}
		format = Format(i)
	}
	l.Format = format
	if !l.RecordFormat().CloudEvents() {
		if source != "" {
			return fmt.Errorf("--cloudevents-source %q is set but --record-format is %s: the source goes only into CloudEvents records; drop it, or use --record-format %s or %s",
				source, l.RecordFormat(), FormatNameCloudEvents, FormatNameCloudEventsStructured)
		}
		if len(l.HeaderColumns) > 0 && l.RecordFormat() == FormatRelay {
			return errors.New("--header-columns with --record-format relay: the relay's records carry extra headers from the headers column only; drop --header-columns, or use another --record-format")
		}
		return nil
	}
	if err := ValidCloudEventsSource(source); err != nil {
		return fmt.Errorf("--cloudevents-source %q with --record-format %s: %w", source, l.RecordFormat(), err)
	}
	l.CloudEventsSource = source
	for _, name := range l.HeaderNames() {
		if CloudEventsHeader(name) {
			return fmt.Errorf("--header-columns: header %q would clash with the CloudEvents binding's headers (ce_* and content-type); give the column another header name with column:header", name)
		}
	}
	return nil
}

// SetContentType sets the payloads' media type from --content-type:
// empty, or a media type such as application/x-protobuf, which goes into
// every record's content-type header (in structured CloudEvents, its
// datacontenttype).
func (l *Layout) SetContentType(contentType string) error {
	if contentType == "" {
		return nil
	}
	if !ValidMediaType([]byte(contentType)) {
		return fmt.Errorf("--content-type %q: not a media type such as application/x-protobuf or application/json (RFC 2045)", contentType)
	}
	if l.RecordFormat().CloudEvents() && CloudEventsMediaType([]byte(contentType)) {
		return fmt.Errorf("--content-type %q with --record-format %s: that is the type of a whole structured CloudEvent, not of its data; a reader would take the record for a structured event", contentType, l.RecordFormat())
	}
	for _, h := range l.HeaderColumns {
		if strings.EqualFold(h.Header, "content-type") {
			return fmt.Errorf("--content-type %q: header column %s already fills the content-type header; drop one of them", contentType, h.Column)
		}
	}
	l.ContentType = contentType
	l.contentType = []byte(contentType)
	return nil
}

// ValidMediaType reports whether s is a media type as RFC 9110 (8.3.1)
// writes one: type "/" subtype, each a token, then any number of
// ";" name=value parameters, the value a token or a quoted string. It
// allocates nothing, as it runs for every row that has a content type.
func ValidMediaType(s []byte) bool {
	i := skipToken(s, 0)
	if i == 0 || i == len(s) || s[i] != '/' {
		return false
	}
	j := skipToken(s, i+1)
	if j == i+1 {
		return false
	}
	for i = j; i < len(s); {
		i = skipSpace(s, i)
		if i == len(s) {
			return true
		}
		if s[i] != ';' {
			return false
		}
		i = skipSpace(s, i+1)
		if i == len(s) {
			return true // a trailing ";" is tolerated, as Go's mime package does
		}
		name := skipToken(s, i)
		if name == i || name == len(s) || s[name] != '=' {
			return false
		}
		i = name + 1
		if i < len(s) && s[i] == '"' {
			if i = skipQuoted(s, i+1); i < 0 {
				return false
			}
			continue
		}
		if value := skipToken(s, i); value > i {
			i = value
			continue
		}
		return false
	}
	return true
}

// CloudEventsMediaType reports whether a media type is one of the
// CloudEvents formats' own (application/cloudevents+json, its batch
// form): the binding reads a record of that content-type as a structured
// event, so it can never be the type of an event's data.
func CloudEventsMediaType(s []byte) bool {
	const prefix = "application/cloudevents"
	return len(s) >= len(prefix) && strings.EqualFold(string(s[:len(prefix)]), prefix)
}

func skipToken(s []byte, i int) int {
	for i < len(s) && tokenByte(s[i]) {
		i++
	}
	return i
}

func skipSpace(s []byte, i int) int {
	for i < len(s) && (s[i] == ' ' || s[i] == '\t') {
		i++
	}
	return i
}

// skipQuoted returns the index after a quoted string's closing quote,
// from just after its opening one; -1 when it does not close.
func skipQuoted(s []byte, i int) int {
	for i < len(s) {
		switch c := s[i]; {
		case c == '"':
			return i + 1
		case c == '\\' && i+1 < len(s):
			i += 2
		case c < 0x20 && c != '\t' || c == 0x7f:
			return -1
		default:
			i++
		}
	}
	return -1
}

// tokenByte is tchar of RFC 9110 (5.6.2).
func tokenByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// ContentTypeBytes is ContentType as bytes, made once so the record
// builder does not convert it per event. The caller must not change it.
func (l *Layout) ContentTypeBytes() []byte { return l.contentType }

// ValidCloudEventsSource checks a CloudEvents source attribute: a
// non-empty URI reference (RFC 3986), such as
// "https://example.com/billing" or "/billing/outbox". The check is strict
// (ASCII, no spaces, well-formed percent escapes) because every consumer's
// SDK parses the attribute, and one it cannot parse fails every event.
func ValidCloudEventsSource(source string) error {
	if source == "" {
		return errors.New("the CloudEvents formats need a source, the URI reference every event's source attribute carries (e.g. https://example.com/billing or /billing/outbox)")
	}
	for i := 0; i < len(source); i++ {
		c := source[i]
		if !uriByte(c) {
			return fmt.Errorf("byte %q at offset %d is not allowed in a URI reference (RFC 3986); percent-encode it", c, i)
		}
		if c == '%' && (i+2 >= len(source) || !isHex(source[i+1]) || !isHex(source[i+2])) {
			return fmt.Errorf("'%%' at offset %d does not start a percent escape of two hex digits", i)
		}
	}
	if strings.Count(source, "#") > 1 {
		return errors.New("a URI reference has at most one '#'")
	}
	// Well-formed bytes can still make no URI ("http://[::1"): every
	// record would then be one a CloudEvents reader refuses.
	if _, err := url.Parse(source); err != nil {
		return fmt.Errorf("not a URI reference (RFC 3986): %w", errors.Unwrap(err))
	}
	return nil
}

// uriByte reports whether c may appear in a URI reference: unreserved,
// reserved, or the '%' of an escape.
func uriByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("-._~:/?#[]@!$&'()*+,;=%", c) >= 0
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// CloudEventsHeader reports whether a header name belongs to the
// CloudEvents Kafka binding, which reads every ce_ header as an attribute
// and content-type as the data's type; SDKs lower-case the names first.
func CloudEventsHeader(name string) bool {
	return len(name) >= 3 && strings.EqualFold(name[:3], "ce_") || strings.EqualFold(name, "content-type")
}

func validColumn(flag, name string) error {
	if len(name) > 63 || strings.ContainsRune(name, 0) {
		return fmt.Errorf("%s %q: a column name is 1 to 63 bytes with no NUL byte", flag, name)
	}
	return nil
}

// RecordFormat is the records' format: Format, or the table layout's own.
func (l *Layout) RecordFormat() Format {
	switch {
	case l.Format != FormatDefault:
		return l.Format
	case l.Shape == ShapeDebezium:
		return FormatDebezium
	}
	return FormatRelay
}

// Name is the layout's --outbox-layout value.
func (l *Layout) Name() string {
	if l.Shape == ShapeDebezium {
		return NameDebezium
	}
	return NameRelay
}

// Column is the table column that holds a field; empty when the layout
// reads no column for it.
func (l *Layout) Column(f Field) string {
	if c := l.Columns[f]; c != "" {
		return c
	}
	return fields[f].columns[l.Shape]
}

// Required reports whether the table must have the field's column: the
// layout's required columns, and the event type when the records carry it.
func (l *Layout) Required(f Field) bool {
	required := fields[f].required[l.Shape] || f == EventType && l.EventTypeRequired()
	return required && l.Column(f) != ""
}

// RequiredColumns are the columns every row must come with.
func (l *Layout) RequiredColumns() []string {
	var out []string
	for f := Field(0); f < NumFields; f++ {
		if l.Required(f) {
			out = append(out, l.Column(f))
		}
	}
	return out
}

// ColumnIndex maps each column the relay reads to where its value goes:
// a Field, or NumFields+i for header column i. A column that is both a
// field and a header column maps to the field; HeaderIndex has the other.
func (l *Layout) ColumnIndex() (fieldOf map[string]int, headerOf map[string][]int) {
	fieldOf = make(map[string]int, NumFields)
	for f := Field(0); f < NumFields; f++ {
		if c := l.Column(f); c != "" {
			fieldOf[c] = int(f)
		}
	}
	if len(l.HeaderColumns) > 0 {
		headerOf = make(map[string][]int, len(l.HeaderColumns))
		for i, h := range l.HeaderColumns {
			headerOf[h.Column] = append(headerOf[h.Column], i)
		}
	}
	return fieldOf, headerOf
}

// HeaderNames are the header names of the header columns, in order.
func (l *Layout) HeaderNames() []string {
	names := make([]string, len(l.HeaderColumns))
	for i, h := range l.HeaderColumns {
		names[i] = h.Header
	}
	return names
}

// HeaderKeys are the header names of the header columns, in order, as
// bytes. The caller must not change them.
func (l *Layout) HeaderKeys() [][]byte {
	if len(l.headerKeys) != len(l.HeaderColumns) {
		keys := make([][]byte, len(l.HeaderColumns))
		for i, h := range l.HeaderColumns {
			keys[i] = []byte(h.Header)
		}
		return keys
	}
	return l.headerKeys
}

// EventIDHeader is the header that carries the event id in a record;
// empty for the structured CloudEvents format, whose value carries it.
func (l *Layout) EventIDHeader() string {
	switch l.RecordFormat() {
	case FormatDebezium:
		return "id"
	case FormatCloudEvents:
		return "ce_id"
	case FormatCloudEventsStructured:
		return ""
	}
	return "event_id"
}

// PayloadNullable reports whether a SQL NULL payload is an event rather
// than a row to refuse: only Debezium's table allows one, and every format
// but the relay's has a record for it (the router's null value, a
// CloudEvent without data).
func (l *Layout) PayloadNullable() bool {
	return l.Shape == ShapeDebezium && l.RecordFormat() != FormatRelay
}

// EventTypeRequired reports whether a row needs an event type: the relay's
// records carry it in a header and CloudEvents in the required type
// attribute; Debezium's router places it nowhere.
func (l *Layout) EventTypeRequired() bool { return l.RecordFormat() != FormatDebezium }

// CreatesTable reports whether migrate creates the outbox table: the
// relay defines its own, and takes over a Debezium table as it stands.
func (l *Layout) CreatesTable() bool { return l.Shape == ShapeRelay }

// ColumnProblems compares a table's columns (name to base type, as
// format_type() names it) with what the layout reads, and names every
// column at fault, with the flag that maps it when the layout is not the
// relay's own.
func (l *Layout) ColumnProblems(found map[string]string) []string {
	var problems []string
	for f := Field(0); f < NumColumns; f++ {
		col := l.Column(f)
		if col == "" {
			continue
		}
		rule := fields[f]
		name := col
		if l.Shape != ShapeRelay || l.Columns[f] != "" {
			name = fmt.Sprintf("%s (%s)", col, rule.flag)
		}
		typ, ok := found[col]
		switch {
		case !ok && l.Columns[f] != "":
			// A flag that names no column would otherwise read as an
			// optional column the table lacks: every record would lose
			// the field without a word.
			problems = append(problems, fmt.Sprintf("column %s is missing: %s names a column the table does not have", name, rule.flag))
		case !ok && l.Required(f):
			problems = append(problems, fmt.Sprintf("column %s is missing (want %s)", name, strings.Join(rule.types, " or ")))
		case ok && !slices.Contains(rule.types, typ):
			problems = append(problems, fmt.Sprintf("column %s is %s, want %s", name, typ, strings.Join(rule.types, " or ")))
		case ok && f == OccurredAt && typ == "timestamp without time zone" && l.RecordFormat().CloudEvents():
			// Its text has no offset, so it is no RFC 3339 time, which
			// the time attribute must be.
			problems = append(problems, fmt.Sprintf("column %s is %s, want timestamp with time zone for --record-format %s (the time attribute is RFC 3339, with an offset)", name, typ, l.RecordFormat()))
		}
	}
	for _, h := range l.HeaderColumns {
		if _, ok := found[h.Column]; !ok {
			problems = append(problems, fmt.Sprintf("column %s (--header-columns) is missing", h.Column))
		}
	}
	return problems
}

// ErrColumnMapping marks a table that does not have a column a flag names,
// or whose columns do not match a layout other than the relay's own: the
// flags and the table disagree, which is bad configuration, not a state
// that retrying fixes.
var ErrColumnMapping = errors.New("columns do not match the layout")

// MissingNamedColumns names each column that a --column-* flag or
// --header-columns names and the table lacks (has says which it has), with
// its flag. Reading such a column as an absent optional one would drop its
// field from every record silently.
func (l *Layout) MissingNamedColumns(has func(column string) bool) []string {
	var missing []string
	for f := Field(0); f < NumColumns; f++ {
		if c := l.Columns[f]; c != "" && !has(c) {
			missing = append(missing, fmt.Sprintf("%s (%s)", c, fields[f].flag))
		}
	}
	for _, h := range l.HeaderColumns {
		if !has(h.Column) {
			missing = append(missing, h.Column+" (--header-columns)")
		}
	}
	return missing
}

// SelectList is the SELECT list that reads a row in the text forms the
// replication stream delivers, so a record built from it is byte for byte
// what `run` sends: the NumFields fields in Field order, then the header
// columns. A column the layout does not read, or an optional one the table
// lacks (present says which it has), is read as NULL, as the stream does.
// quote quotes an identifier.
func (l *Layout) SelectList(present map[string]bool, quote func(string) string) string {
	return strings.Join(l.SelectExprs(present, quote), ", ")
}

// SelectExprs is SelectList's expressions, one per field, then one per
// header column.
func (l *Layout) SelectExprs(present map[string]bool, quote func(string) string) []string {
	exprs := make([]string, 0, int(NumFields)+len(l.HeaderColumns))
	for f := Field(0); f < NumFields; f++ {
		col := l.Column(f)
		if col == "" || !present[col] && !l.Required(f) {
			exprs = append(exprs, "NULL::text")
			continue
		}
		exprs = append(exprs, quote(col)+fields[f].cast)
	}
	for _, h := range l.HeaderColumns {
		exprs = append(exprs, quote(h.Column)+"::text")
	}
	return exprs
}
