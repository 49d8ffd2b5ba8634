package replication

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/messages"
)

// Kind says what a Message carries.
type Kind uint8

const (
	// KindNone: nothing arrived before the deadline.
	KindNone Kind = iota
	// KindBegin: a committed transaction starts; Message.CommitTime and XID are set.
	KindBegin
	// KindRow: an insert into the outbox table; Message.Row is set.
	KindRow
	// KindCommit: the transaction is complete; CommitLSN and EndLSN are set.
	KindCommit
	// KindKeepalive: the server's heartbeat; ServerWALEnd and ReplyRequested are set.
	KindKeepalive
	// KindOther: anything else (relation, type, origin, other tables); skip it.
	KindOther
	// KindSkippedMessage: a logical decoding message the messages source
	// must not publish; Message.Skipped says why.
	KindSkippedMessage
)

// Skip says why a logical decoding message is not an event.
type Skip uint8

const (
	// SkipNonTransactional: the message was emitted with transactional
	// false, so it was decoded at once, whether its transaction committed
	// or not.
	SkipNonTransactional Skip = iota + 1
	// SkipOtherPrefix: the message is another application's; every
	// logical slot of the database receives every message.
	SkipOtherPrefix
)

// Field indexes into Row.Values, one per field the relay reads; the
// layout names the column of each.
const (
	FieldEventID       = layout.EventID
	FieldAggregateType = layout.AggregateType
	FieldAggregateID   = layout.AggregateID
	FieldEventType     = layout.EventType
	FieldSchemaVersion = layout.SchemaVersion
	FieldPayload       = layout.Payload
	FieldHeaders       = layout.Headers
	FieldOccurredAt    = layout.OccurredAt
	FieldContentType   = layout.ContentType
	numFields          = int(layout.NumFields)
)

// Row is one outbox insert, as text. The slices alias the connection's read
// buffer and are valid only until the next Receive; a nil slice is SQL NULL
// or a column the table does not have.
type Row struct {
	Values [numFields][]byte
	// Extra holds the layout's header columns, in order; nil in the
	// relay's own layout, which has none.
	Extra [][]byte
	// Unmapped says why the row cannot be published as it is: the table
	// lacked a required column when the row was written. Values holds the
	// columns it did have. PostgreSQL decodes a row with the columns of
	// its time, so a later ALTER TABLE never changes this: the row must be
	// set aside, or the stream can never pass it.
	Unmapped string
	// PayloadBinary says the payload is a bytea, in its text form (\x
	// and hex), as pgoutput sends every value; the record builder
	// decodes it. The table's type when the row was written decides, as
	// for Unmapped.
	PayloadBinary bool
	// Content is the logical decoding message the row was decoded from
	// (the messages source), as it arrived, and ContentAt its WAL
	// position; nil for a table's row. The quarantine keeps it when the
	// values cannot be the event, so no byte a writer emitted is lost.
	Content   []byte
	ContentAt lsn.LSN
	// Dropped, for a message whose content the connection dropped unread
	// for its size (--max-message-bytes), is what is known of it; nil
	// otherwise. Content is then nil and ContentAt its position.
	Dropped *Oversized
}

// Message is one decoded replication message. Receive reuses it.
type Message struct {
	Kind Kind

	// WALStart is where the message's WAL data starts (XLogData only).
	WALStart lsn.LSN
	// ServerWALEnd is the server's WAL end when it sent the message.
	ServerWALEnd   lsn.LSN
	ReplyRequested bool

	XID        uint32
	CommitTime time.Time
	CommitLSN  lsn.LSN
	EndLSN     lsn.LSN

	Row Row
	// Skipped says why a KindSkippedMessage is not published.
	Skipped Skip
}

// relation is the decoder's record of one table from a Relation message.
type relation struct {
	outbox  bool
	fieldOf []int8 // column position -> field, or -1
	// headerOf is, by column position, the header columns it fills; nil
	// when the layout has none, so the relay's own layout pays nothing.
	headerOf [][]int
	// unmapped is set for an outbox relation that lacks a required
	// column; its rows carry it as Row.Unmapped.
	unmapped string
	// names are the columns, by position, for what the relay says of a
	// row.
	names []string
	// payloadBinary says the payload column is a bytea; its rows carry
	// it as Row.PayloadBinary.
	payloadBinary bool
}

// byteaOID is bytea's type OID, fixed in PostgreSQL's catalog.
const byteaOID = 17

// decoder turns pgoutput protocol version 1 messages into Messages.
type decoder struct {
	schema, table string
	layout        *layout.Layout
	// fieldOf and headerOf map column names as the layout says.
	fieldOf  map[string]int
	headerOf map[string][]int
	// extra backs Row.Extra, reused for every row.
	extra     [][]byte
	relations map[uint32]*relation

	// messages decodes the contents of the messages source's logical
	// decoding messages with prefix; nil when the source is the table.
	messages *messages.Decoder
	prefix   []byte
	// commitTime is the open transaction's, for a message's default
	// occurred_at.
	commitTime time.Time
	// oversized knows the messages whose content, and the rows whose
	// values, the connection dropped for their size; nil when nothing is
	// dropped. dropped names a row's dropped values while it is decoded.
	oversized *oversizeFilter
	dropped   []string
}

func newDecoder(schema, table string, l *layout.Layout) *decoder {
	fieldOf, headerOf := l.ColumnIndex()
	return &decoder{schema: schema, table: table, layout: l, fieldOf: fieldOf, headerOf: headerOf,
		extra: make([][]byte, len(l.HeaderColumns)), relations: make(map[uint32]*relation)}
}

// newMessageDecoder decodes the messages source's stream: the
// transactional messages with prefix are its events, and no table is.
func newMessageDecoder(prefix string) *decoder {
	d := newDecoder("", "", layout.Relay)
	d.messages, d.prefix = &messages.Decoder{}, []byte(prefix)
	return d
}

var errShort = errors.New("message too short")

// pgEpoch is PostgreSQL's timestamp origin.
var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()

func pgTime(micros int64) time.Time { return time.UnixMicro(pgEpoch + micros).UTC() }

// decode reads one pgoutput message (the payload of an XLogData) into m.
func (d *decoder) decode(data []byte, m *Message) error {
	if len(data) == 0 {
		return errShort
	}
	body := data[1:]
	switch data[0] {
	case 'B':
		if len(body) < 20 {
			return fmt.Errorf("begin: %w", errShort)
		}
		m.Kind = KindBegin
		m.CommitLSN = lsn.LSN(binary.BigEndian.Uint64(body))
		m.CommitTime = pgTime(int64(binary.BigEndian.Uint64(body[8:])))
		m.XID = binary.BigEndian.Uint32(body[16:])
		d.commitTime = m.CommitTime
	case 'C':
		if len(body) < 25 {
			return fmt.Errorf("commit: %w", errShort)
		}
		m.Kind = KindCommit
		m.CommitLSN = lsn.LSN(binary.BigEndian.Uint64(body[1:]))
		m.EndLSN = lsn.LSN(binary.BigEndian.Uint64(body[9:]))
		m.CommitTime = pgTime(int64(binary.BigEndian.Uint64(body[17:])))
	case 'R':
		m.Kind = KindOther
		return d.relation(body)
	case 'I':
		return d.insert(body, m)
	case 'M':
		return d.message(body, m)
	default:
		// Type, Origin, Update, Delete, Truncate and any later
		// additions say nothing the relay needs.
		m.Kind = KindOther
	}
	return nil
}

func (d *decoder) relation(b []byte) error {
	if len(b) < 4 {
		return fmt.Errorf("relation: %w", errShort)
	}
	oid := binary.BigEndian.Uint32(b)
	b = b[4:]
	namespace, b, err := cstring(b)
	if err != nil {
		return fmt.Errorf("relation %d namespace: %w", oid, err)
	}
	name, b, err := cstring(b)
	if err != nil {
		return fmt.Errorf("relation %d name: %w", oid, err)
	}
	if len(b) < 3 {
		return fmt.Errorf("relation %s.%s: %w", namespace, name, errShort)
	}
	ncols := int(binary.BigEndian.Uint16(b[1:]))
	b = b[3:]
	rel := &relation{outbox: namespace == d.schema && name == d.table, fieldOf: make([]int8, ncols)}
	if rel.outbox && d.headerOf != nil {
		rel.headerOf = make([][]int, ncols)
	}
	seen := make(map[string]bool, ncols)
	names := make([]string, 0, ncols)
	for i := 0; i < ncols; i++ {
		if len(b) < 1 {
			return fmt.Errorf("relation %s.%s column %d: %w", namespace, name, i, errShort)
		}
		var col string
		col, b, err = cstring(b[1:])
		if err != nil || len(b) < 8 {
			return fmt.Errorf("relation %s.%s column %d: %w", namespace, name, i, errShort)
		}
		typ := binary.BigEndian.Uint32(b)
		b = b[8:] // type OID and modifier
		names = append(names, col)
		rel.fieldOf[i] = -1
		if f, ok := d.fieldOf[col]; ok {
			rel.fieldOf[i] = int8(f)
			seen[col] = true
			rel.payloadBinary = rel.payloadBinary || f == int(FieldPayload) && typ == byteaOID
		}
		if rel.headerOf != nil {
			rel.headerOf[i] = d.headerOf[col]
		}
	}
	if rel.outbox {
		required := d.layout.RequiredColumns()
		var missing []string
		for _, col := range required {
			if !seen[col] {
				missing = append(missing, strconv.Quote(col))
			}
		}
		if len(missing) > 0 {
			// Not an error: failing here would fail every session at the
			// same place, since the slot re-sends this relation with each
			// row written under it.
			rel.unmapped = fmt.Sprintf("outbox table %s.%s had no column %s when this row was written (its columns then: %s); the relay needs %s",
				namespace, name, strings.Join(missing, ", "), strings.Join(names, ", "), strings.Join(required, ", "))
		}
	}
	rel.names = names
	d.relations[oid] = rel
	return nil
}

func (d *decoder) insert(b []byte, m *Message) error {
	if len(b) < 7 {
		return fmt.Errorf("insert: %w", errShort)
	}
	oid := binary.BigEndian.Uint32(b)
	rel, ok := d.relations[oid]
	if !ok {
		return fmt.Errorf("insert into relation %d before its relation message", oid)
	}
	if !rel.outbox {
		m.Kind = KindOther
		return nil
	}
	if b[4] != 'N' {
		return fmt.Errorf("insert: unexpected tuple marker %q", b[4])
	}
	ncols := int(binary.BigEndian.Uint16(b[5:]))
	b = b[7:]
	m.Kind = KindRow
	m.Row = Row{Unmapped: rel.unmapped, PayloadBinary: rel.payloadBinary}
	if rel.headerOf != nil {
		// A header column the table lacks is NULL, as a missing optional
		// column is.
		clear(d.extra)
		m.Row.Extra = d.extra
	}
	for i := 0; i < ncols; i++ {
		if len(b) < 1 {
			return fmt.Errorf("insert column %d: %w", i, errShort)
		}
		kind := b[0]
		b = b[1:]
		var value []byte
		switch kind {
		case 'n':
		case 'u':
			// An insert carries every value; 'u' is a value the
			// connection dropped for its size (oversizeFilter).
			if o, ok := d.oversized.takeColumn(uint64(m.WALStart), i); ok {
				d.dropColumn(rel, i, o, m)
			}
		case 't', 'b':
			if len(b) < 4 {
				return fmt.Errorf("insert column %d: %w", i, errShort)
			}
			n := int(int32(binary.BigEndian.Uint32(b)))
			if n < 0 || len(b)-4 < n {
				return fmt.Errorf("insert column %d: length %d: %w", i, n, errShort)
			}
			value = b[4 : 4+n : 4+n]
			b = b[4+n:]
		default:
			return fmt.Errorf("insert column %d: unknown tuple data kind %q", i, kind)
		}
		if i < len(rel.fieldOf) && rel.fieldOf[i] >= 0 {
			m.Row.Values[rel.fieldOf[i]] = value
		}
		if rel.headerOf != nil && i < len(rel.headerOf) {
			for _, h := range rel.headerOf[i] {
				m.Row.Extra[h] = value
			}
		}
	}
	if len(d.dropped) > 0 {
		d.droppedProblem(m)
	}
	return nil
}

// dropColumn notes that the connection dropped column i of a row for its
// size (see dropped).
func (d *decoder) dropColumn(rel *relation, i int, o Oversized, m *Message) {
	name := strconv.Itoa(i)
	if i < len(rel.names) {
		name = rel.names[i]
	}
	d.dropped = append(d.dropped, fmt.Sprintf("column %s (%d bytes, sha256 %x)", name, o.Size, o.SHA256))
	if m.Row.Dropped == nil || o.Size > m.Row.Dropped.Size {
		m.Row.Dropped = &o
	}
}

// droppedProblem makes a row whose large values the connection dropped one
// to quarantine, naming each; the row itself stays in the outbox table.
func (d *decoder) droppedProblem(m *Message) {
	problem := fmt.Sprintf("%s over --max-message-bytes %d: the relay dropped it unread to bound its memory; the row stays in the outbox table. "+
		"To publish it, raise the topic's max.message.bytes, --kafka-max-message-bytes and --max-message-bytes (the relay holds a few copies of each row up to it), then republish it with `outbox-relay reconcile --republish` over its insert time",
		strings.Join(d.dropped, " and "), d.oversized.limit)
	if m.Row.Unmapped != "" {
		problem = m.Row.Unmapped + "; " + problem
	}
	m.Row.Unmapped = problem
	d.dropped = d.dropped[:0]
}

// message reads a logical decoding message: flags (1 = transactional), its
// LSN, the prefix, and the content.
func (d *decoder) message(b []byte, m *Message) error {
	m.Kind = KindOther
	if d.messages == nil {
		return nil // the table source does not ask for messages
	}
	if len(b) < 9 {
		return fmt.Errorf("message: %w", errShort)
	}
	transactional := b[0]&1 != 0
	at := binary.BigEndian.Uint64(b[1:])
	end := bytes.IndexByte(b[9:], 0)
	if end < 0 || len(b) < 9+end+1+4 {
		return fmt.Errorf("message at %s: %w", lsn.LSN(at), errShort)
	}
	prefix := b[9 : 9+end]
	b = b[9+end+1:]
	n := int(binary.BigEndian.Uint32(b))
	if n < 0 || len(b)-4 < n {
		return fmt.Errorf("message at %s: content length %d: %w", lsn.LSN(at), n, errShort)
	}
	content := b[4 : 4+n]
	switch {
	case !bytes.Equal(prefix, d.prefix):
		m.Kind, m.Skipped = KindSkippedMessage, SkipOtherPrefix
	case !transactional:
		m.Kind, m.Skipped = KindSkippedMessage, SkipNonTransactional
	default:
		m.Kind = KindRow
		m.Row = Row{}
		if o, ok := d.oversized.take(at); ok && n == 0 {
			m.Row.Unmapped = d.messages.Oversized(at, o.Size, o.SHA256[:], d.oversized.limit, d.commitTime, &m.Row.Values)
			m.Row.Dropped, m.Row.ContentAt = &o, lsn.LSN(at)
			return nil
		}
		m.Row.Unmapped = d.messages.Decode(content, at, d.commitTime, &m.Row.Values)
		m.Row.PayloadBinary = d.messages.PayloadBinary()
		m.Row.Content, m.Row.ContentAt = content, lsn.LSN(at)
	}
	if n == 0 {
		// Dropped for its size but skipped here: forget it.
		d.oversized.take(at)
	}
	return nil
}

func cstring(b []byte) (string, []byte, error) {
	for i, c := range b {
		if c == 0 {
			return string(b[:i]), b[i+1:], nil
		}
	}
	return "", nil, errShort
}
