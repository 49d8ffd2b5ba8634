// Package messages is the contract of the table-free source: an outbox
// event carried in the WAL by pg_logical_emit_message(true, prefix,
// content) instead of an outbox row. It turns a message's content, one JSON
// object with the outbox row's fields, into the text values the table
// source's WAL row carries, so that the record built from a message is byte
// for byte the one built from the same row in the outbox table.
package messages

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/outbox-relay/outbox-relay/layout"
)

// DefaultPrefix is the prefix the relay reads when --message-prefix is not
// given, and the one the writer library emits with by default.
const DefaultPrefix = "outbox"

// Values are an event's fields as text, indexed by layout.Field, as the
// table source's WAL row holds them; nil is SQL NULL.
type Values = [layout.NumFields][]byte

// Decoder decodes message contents. It reuses one buffer for the values of
// the last content decoded, so those stay valid only until the next
// Decode; it is used from one goroutine.
type Decoder struct {
	buf []byte
	// raw holds a payload_base64's bytes while they are turned into
	// bytea's text form; reused.
	raw []byte
	// binary says the last content decoded carried payload_base64.
	binary bool
	// keys are the member names of the content being decoded, so that a
	// member given twice is found; keySet takes over from the list for a
	// content with many members, so no content costs quadratic time.
	keys   [][]byte
	keySet map[string]struct{}
}

// PayloadBinary reports whether the last content decoded carried its
// payload as payload_base64: the payload value is then the bytes in
// bytea's hex text form, as a bytea column's value arrives in the WAL.
func (d *Decoder) PayloadBinary() bool { return d.binary }

// memberPayloadBase64 is the member that carries a binary payload, base64
// (RFC 4648, standard alphabet, padded) in a JSON string, in place of
// payload: JSON has no bytes.
const memberPayloadBase64 = "payload_base64"

// Decode fills v from a message's content. commitTime stands in for an
// absent occurred_at: the table's default is the transaction's start time,
// which the WAL does not carry, and the commit is the closest time it
// does. A content that is not an outbox event returns a problem that says
// what is wrong; v then holds what could be read, and always an event ID
// and a payload, so the event can be kept in the quarantine table (an ID
// derived from the message's WAL position when the content has no valid
// one, and the whole content as a JSON string when it is no JSON object).
func (d *Decoder) Decode(content []byte, at uint64, commitTime time.Time, v *Values) (problem string) {
	*v = Values{}
	d.buf, d.binary = d.buf[:0], false
	problem = d.decode(content, commitTime, v)
	// The names alias content, which must not outlive the call here.
	clear(d.keys)
	d.keys, d.keySet = d.keys[:0], nil
	if problem == "" {
		return ""
	}
	if v[layout.OccurredAt] == nil {
		// As for a valid event: a replay after the operator fixed the row
		// then carries the time the relay knows, not an empty header.
		var text [40]byte
		v[layout.OccurredAt] = d.keep(pgTimestamp(text[:0], commitTime))
	}
	if v[layout.EventID] == nil {
		v[layout.EventID] = d.keep([]byte(DerivedEventID(at)))
	}
	if v[layout.Payload] == nil {
		quoted, _ := json.Marshal(string(content))
		v[layout.Payload] = d.keep(quoted)
	}
	if v[layout.SchemaVersion] == nil {
		v[layout.SchemaVersion] = d.keep([]byte("1"))
	}
	for _, f := range []layout.Field{layout.AggregateType, layout.AggregateID, layout.EventType} {
		if v[f] == nil {
			v[f] = []byte{}
		}
	}
	return "message content is not an outbox event: " + problem +
		"; emit one JSON object with event_id (uuid), aggregate_type, aggregate_id, event_type and payload (the writer library's Emit builds it)"
}

// Oversized fills v for a message whose content (size bytes, with the
// given SHA-256) was larger than limit, so the connection dropped it
// unread: no field of it is known, and the quarantine keeps the reference
// (the WAL position, the size, the digest) under an ID derived from the
// position, as for any content that is no event. commitTime stands in for
// occurred_at.
func (d *Decoder) Oversized(at uint64, size int64, sha256 []byte, limit int, commitTime time.Time, v *Values) (problem string) {
	*v = Values{}
	d.buf, d.binary = d.buf[:0], false
	v[layout.EventID] = d.keep([]byte(DerivedEventID(at)))
	v[layout.SchemaVersion] = d.keep(one)
	var text [40]byte
	v[layout.OccurredAt] = d.keep(pgTimestamp(text[:0], commitTime))
	for _, f := range []layout.Field{layout.AggregateType, layout.AggregateID, layout.EventType} {
		v[f] = []byte{}
	}
	return fmt.Sprintf("message content is %d bytes, over --max-message-bytes %d, so the relay dropped it unread to bound its memory; kept by reference: WAL position %X/%X, sha256 %x. "+
		"The content leaves the WAL once the slot passes it: have the writer emit the event again in smaller parts, or raise --max-message-bytes (the relay holds a few copies of each message up to it)",
		size, limit, at>>32, uint32(at), sha256)
}

// DerivedEventID names a content that has no valid event ID by its
// message's WAL position, which is the same on every re-delivery, so the
// quarantine table keeps it once. A message quarantined without being read
// (too large to hold) is named the same way.
func DerivedEventID(at uint64) string {
	return uuid.NewSHA1(uuid.NameSpaceOID, []byte("outbox-relay message at "+strconv.FormatUint(at, 16))).String()
}

// keep copies b into the decoder's buffer and returns the copy. The buffer
// is sized before any copy, so earlier copies never move.
func (d *Decoder) keep(b []byte) []byte {
	d.reserve(len(b))
	start := len(d.buf)
	d.buf = append(d.buf, b...)
	return d.buf[start:len(d.buf):len(d.buf)]
}

// keepBytea is keep of raw's bytea hex text form.
func (d *Decoder) keepBytea(raw []byte) []byte {
	d.reserve(2 + 2*len(raw))
	start := len(d.buf)
	d.buf = hex.AppendEncode(append(d.buf, '\\', 'x'), raw)
	return d.buf[start:len(d.buf):len(d.buf)]
}

// reserve makes room for n more bytes in the buffer without moving what
// it holds.
func (d *Decoder) reserve(n int) {
	if cap(d.buf)-len(d.buf) < n {
		// A new array: the values already kept point into the old one.
		d.buf = make([]byte, 0, max(2*cap(d.buf), n+256))
	}
}

func (d *Decoder) decode(content []byte, commitTime time.Time, v *Values) string {
	if !json.Valid(content) {
		return "not valid JSON"
	}
	var object members
	if !object.start(content) {
		return "not a JSON object"
	}
	var seen uint16
	var problems []string
	var repeated []string
	for {
		key, value, ok := object.next()
		if !ok {
			break
		}
		if d.repeated(key) {
			// Which of the two a writer meant is unknowable, and JSON
			// parsers disagree (first wins, last wins): refuse both.
			if !slices.Contains(repeated, string(key)) {
				repeated = append(repeated, string(key))
			}
			continue
		}
		if string(key) == memberPayloadBase64 {
			if seen&(1<<layout.Payload) != 0 {
				problems = append(problems, "both payload and payload_base64")
				continue
			}
			seen |= 1 << layout.Payload
			if p := d.payloadBase64(value, v); p != "" {
				problems = append(problems, p)
			}
			continue
		}
		f, ours := fieldNamed(key)
		if !ours {
			continue // a later writer may add members
		}
		if f == layout.Payload && seen&(1<<f) != 0 {
			problems = append(problems, "both payload and payload_base64")
			continue
		}
		seen |= 1 << f
		if p := d.field(f, value, v); p != "" {
			problems = append(problems, p)
		}
	}
	if len(repeated) > 0 {
		quoted := make([]string, len(repeated))
		for i, k := range repeated {
			quoted[i] = strconv.Quote(k)
		}
		plural := ""
		if len(repeated) > 1 {
			plural = "s"
		}
		problems = append(problems, "duplicate member"+plural+" "+strings.Join(quoted, ", "))
	}
	var missing []string
	for _, f := range required {
		if seen&(1<<f) == 0 {
			missing = append(missing, layout.Relay.Column(f))
		}
	}
	if len(missing) > 0 {
		problems = append(problems, "no "+strings.Join(missing, ", "))
	}
	if len(problems) > 0 {
		return strings.Join(problems, "; ")
	}
	if v[layout.SchemaVersion] == nil {
		v[layout.SchemaVersion] = one
	}
	if v[layout.OccurredAt] == nil {
		var text [40]byte
		v[layout.OccurredAt] = d.keep(pgTimestamp(text[:0], commitTime))
	}
	return ""
}

// repeated reports whether the content being decoded already had a member
// named key, and remembers key.
func (d *Decoder) repeated(key []byte) bool {
	if d.keySet != nil {
		if _, ok := d.keySet[string(key)]; ok {
			return true
		}
		d.keySet[string(key)] = struct{}{}
		return false
	}
	for _, k := range d.keys {
		if bytes.Equal(k, key) {
			return true
		}
	}
	d.keys = append(d.keys, key)
	if len(d.keys) > 16 {
		d.keySet = make(map[string]struct{}, 2*len(d.keys))
		for _, k := range d.keys {
			d.keySet[string(k)] = struct{}{}
		}
	}
	return false
}

// payloadBase64 takes a payload_base64 member: its bytes, kept in bytea's
// hex text form so the record builder takes them as it takes a bytea
// column's.
func (d *Decoder) payloadBase64(value []byte, v *Values) string {
	s, ok := d.text(value)
	if !ok {
		return "payload_base64 is not a string"
	}
	raw, err := base64.StdEncoding.AppendDecode(d.raw[:0], s)
	d.raw = raw
	if err != nil {
		return "payload_base64 is not base64 (RFC 4648, standard alphabet, padded)"
	}
	v[layout.Payload] = d.keepBytea(raw)
	d.binary = true
	return ""
}

// one is the default schema version, as the column's default prints.
var one = []byte("1")

// required are the members every content must have: the table's NOT NULL
// columns without a default.
var required = [...]layout.Field{layout.EventID, layout.AggregateType, layout.AggregateID, layout.EventType, layout.Payload}

// fieldNamed is the field a member name stands for: the relay layout's
// column names, which the content shares.
func fieldNamed(key []byte) (layout.Field, bool) {
	for f := layout.Field(0); f < layout.NumFields; f++ {
		// A field the relay's layout reads no column for (the content
		// type) has no member either.
		if c := layout.Relay.Column(f); c != "" && string(key) == c {
			return f, true
		}
	}
	return 0, false
}

// field takes one member of the content; a problem says why it cannot.
func (d *Decoder) field(f layout.Field, value []byte, v *Values) string {
	name := layout.Relay.Column(f)
	switch f {
	case layout.EventID:
		s, ok := d.text(value)
		if !ok {
			return "event_id is not a string"
		}
		id, err := uuid.ParseBytes(s)
		if err != nil {
			return fmt.Sprintf("event_id %q is not a UUID", clip(s))
		}
		// The canonical form, as PostgreSQL prints a uuid column.
		var text [36]byte
		v[f] = d.keep(canonical(text[:0], id))
	case layout.AggregateType, layout.AggregateID, layout.EventType:
		s, ok := d.text(value)
		if !ok {
			return name + " is not a string"
		}
		v[f] = s
	case layout.Payload:
		v[f] = value
	case layout.SchemaVersion:
		n, err := strconv.ParseInt(string(value), 10, 32)
		if err != nil {
			return fmt.Sprintf("schema_version %s is not an integer of 32 bits", clip(value))
		}
		var text [11]byte
		v[f] = d.keep(strconv.AppendInt(text[:0], n, 10))
	case layout.OccurredAt:
		if string(value) == "null" {
			return ""
		}
		s, ok := d.text(value)
		if !ok {
			return "occurred_at is not a string"
		}
		t, err := time.Parse(time.RFC3339Nano, string(s))
		if err != nil {
			return fmt.Sprintf("occurred_at %q is not an RFC 3339 time", clip(s))
		}
		var text [40]byte
		v[f] = d.keep(pgTimestamp(text[:0], t))
	case layout.Headers:
		switch value[0] {
		case 'n': // null: no headers, as a NULL column
		case '{':
			v[f] = value
		default:
			return "headers is not a JSON object"
		}
	}
	return ""
}

// clip is at most the first 64 bytes of a writer's value, for a problem:
// the reason goes into error messages and log lines, which must stay
// short and must not carry a content whole.
func clip(b []byte) []byte {
	if len(b) <= 64 {
		return b
	}
	return append(b[:64:64], "..."...)
}

// canonical is a UUID's lower-case hyphenated form.
func canonical(out []byte, id uuid.UUID) []byte {
	const digits = "0123456789abcdef"
	for i, b := range id {
		if i == 4 || i == 6 || i == 8 || i == 10 {
			out = append(out, '-')
		}
		out = append(out, digits[b>>4], digits[b&0xf])
	}
	return out
}

// text is a JSON string's content: value itself without its quotes when
// it holds no escape, which is the common case, else its unescaped copy.
func (d *Decoder) text(value []byte) ([]byte, bool) {
	if len(value) < 2 || value[0] != '"' {
		return nil, false
	}
	inner := value[1 : len(value)-1]
	if !containsBackslash(inner) {
		return inner, true
	}
	var s string
	if err := json.Unmarshal(value, &s); err != nil {
		return nil, false
	}
	return d.keep([]byte(s)), true
}

// pgTimestamp is t as PostgreSQL prints a timestamptz in UTC, the form the
// table source's WAL row carries.
func pgTimestamp(dst []byte, t time.Time) []byte {
	// PostgreSQL keeps microseconds, rounding the input.
	return t.Round(time.Microsecond).UTC().AppendFormat(dst, "2006-01-02 15:04:05.999999-07")
}
