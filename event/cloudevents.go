package event

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/layout"
)

// CloudEvents is the shape of a CloudEvent (1.0) in the Kafka protocol
// binding, --record-format cloudevents and cloudevents-structured. The key
// stays the aggregate id. The attributes: specversion 1.0, id the event
// id, source the layout's CloudEventsSource, type the event type, subject
// the aggregate id, time occurred_at in RFC 3339 (left out when the row has
// none), and datacontenttype the row's content type or --content-type if set, else application/json
// for a JSON payload, application/octet-stream for a binary (bytea) one,
// else text/plain; a NULL payload is an event without data.
//
// Binary content mode puts each attribute in a ce_ header and the data's
// type in content-type, and the value is the payload as it is. Structured
// mode puts the whole event, the payload as its data (a binary payload
// base64 as data_base64, the JSON format's rule), in the value as JSON,
// with the header content-type application/cloudevents+json. In both modes
// the header columns, then the row's headers column, follow as headers of
// their own; a name the binding reads (ce_*, content-type) is refused, so
// the event is quarantined rather than published with an attribute it did
// not mean. The relay's own headers (event_id, ...) are not sent: the
// attributes carry the same values, and aggregate_type and schema_version
// are in no attribute.
type CloudEvents struct {
	// Structured is structured content mode; false is binary.
	Structured bool
}

var (
	headerCESpecVersion = []byte("ce_specversion")
	headerCEID          = []byte("ce_id")
	headerCESource      = []byte("ce_source")
	headerCEType        = []byte("ce_type")
	headerCESubject     = []byte("ce_subject")
	headerCETime        = []byte("ce_time")
	headerContentType   = []byte("content-type")

	ceSpecVersion    = []byte("1.0")
	ceJSON           = []byte("application/json")
	ceText           = []byte("text/plain; charset=utf-8")
	ceStructuredJSON = []byte("application/cloudevents+json")
	ceOctetStream    = []byte("application/octet-stream")

	// ceData precedes the data in a structured event. An attribute before
	// it cannot hold these bytes, since every quote inside a JSON string is
	// escaped, so their first occurrence is the data's.
	ceData = []byte(`,"data":`)
	// ceDataBase64 precedes a binary payload's base64, after its
	// datacontenttype.
	ceDataBase64 = []byte(`,"data_base64":"`)
)

// Build implements Shape.
func (s CloudEvents) Build(ev *Event, r *Record) error {
	if ev.Layout.CloudEventsSource == "" {
		return errNoCloudEventsSource
	}
	var extraInline [inlineHeaders]Header
	names, extra, n, err := placedHeaders(ev, extraInline[:0], func(key []byte) error {
		if layout.CloudEventsHeader(string(key)) {
			return fmt.Errorf("headers column sets header %q, which the CloudEvents binding reads as an attribute (ce_*) or the data's type (content-type)", key)
		}
		return nil
	})
	if err != nil {
		return err
	}
	n += len(ev.EventID) + len(ev.AggregateID) + len(ev.EventType) + len(ev.AggregateType) +
		len(ev.Layout.CloudEventsSource) + len(ev.OccurredAt) + len(ev.Payload)
	// A text column may hold any text; only JSON is embedded as JSON.
	jsonPayload := ev.Payload == nil || !ev.PayloadBinary && json.Valid(ev.Payload)
	contentType := ceJSON
	switch {
	case len(ev.ContentType) > 0:
		if err := rowContentTypeProblem(ev.ContentType); err != nil {
			return err
		}
		if layout.CloudEventsMediaType(ev.ContentType) {
			return fmt.Errorf("the content-type column holds %q, the type of a whole structured CloudEvent, not of its data: a CloudEvents reader would take the record for a structured event", ev.ContentType)
		}
		contentType = ev.ContentType
	case ev.Layout.ContentType != "":
		contentType = ev.Layout.ContentTypeBytes()
	case ev.PayloadBinary:
		contentType = ceOctetStream
	case !jsonPayload:
		contentType = ceText
	}
	n += len(contentType)
	if s.Structured {
		// The attributes again in the JSON, with their names, punctuation
		// and some room for escapes.
		n += 160 + len(ev.EventID) + len(ev.AggregateID) + len(ev.EventType) + len(ev.Layout.CloudEventsSource) +
			len(ev.OccurredAt) + len(ev.Payload) + len(ev.Payload)/8 + len(contentType)
	}

	a := arena{buf: make([]byte, 0, n)}
	r.EventID = a.take(ev.EventID)
	r.Key = a.take(ev.AggregateID)
	r.EventType = a.take(ev.EventType)
	r.AggregateType = a.take(ev.AggregateType)
	source := a.takeString(ev.Layout.CloudEventsSource)
	var at []byte
	if len(ev.OccurredAt) > 0 {
		if at, err = a.takeCETime(ev.OccurredAt); err != nil {
			return err
		}
	}

	own := 7 // the binding's headers in binary mode, at most
	if s.Structured {
		own = 1
	}
	headers := r.headers(own + len(names) + len(extra))
	switch {
	case s.Structured && ev.PayloadBinary && ev.Payload != nil:
		if r.Value, err = a.structuredBinary(r, source, at, ev.Payload, contentType); err != nil {
			return err
		}
		headers = append(headers, Header{Key: headerContentType, Value: ceStructuredJSON})
	case s.Structured:
		r.Value = a.structured(r, source, at, ev.Payload, contentType, jsonPayload && jsonMediaType(contentType))
		headers = append(headers, Header{Key: headerContentType, Value: ceStructuredJSON})
	default:
		if r.Value, err = a.payload(ev, r, true); err != nil {
			return err
		}
		headers = append(headers,
			Header{Key: headerCESpecVersion, Value: ceSpecVersion},
			Header{Key: headerCEID, Value: r.EventID},
			Header{Key: headerCESource, Value: source},
			Header{Key: headerCEType, Value: r.EventType})
		if len(r.Key) > 0 {
			headers = append(headers, Header{Key: headerCESubject, Value: r.Key})
		}
		if at != nil {
			headers = append(headers, Header{Key: headerCETime, Value: at})
		}
		if r.Value != nil {
			// Copied: a row's value aliases the caller's buffer.
			headers = append(headers, Header{Key: headerContentType, Value: a.take(contentType)})
		}
	}
	r.Headers = a.appendPlaced(headers, ev, names, extra)
	return nil
}

// structuredBinary appends the event with a binary payload as a
// structured-mode JSON object: the format's rule is that bytes go base64
// in data_base64, never in data, with their type in datacontenttype.
func (a *arena) structuredBinary(r *Record, source, at, text, contentType []byte) ([]byte, error) {
	// Decoded apart, because base64 is written from the bytes while the
	// arena grows; structured mode copies the payload twice anyway.
	raw, err := appendBytea(nil, text)
	if err != nil {
		return nil, err
	}
	r.binary = true
	start := len(a.buf)
	b := appendStructuredAttributes(a.buf, r, source, at)
	b = append(b, `,"datacontenttype":`...)
	b = appendJSONString(b, contentType)
	b = append(b, ceDataBase64...)
	b = base64.StdEncoding.AppendEncode(b, raw)
	a.buf = append(b, '"', '}')
	return a.buf[start:len(a.buf):len(a.buf)], nil
}

// structured appends the event as a structured-mode JSON object: the
// attributes in the specification's order, then datacontenttype and data
// last, so that StoreRecord finds the data without parsing the attributes.
// The data is embedded as JSON when embedJSON (a JSON payload of a JSON
// media type), else as a string, the JSON format's rule for any other type.
func (a *arena) structured(r *Record, source, at, payload, contentType []byte, embedJSON bool) []byte {
	start := len(a.buf)
	b := appendStructuredAttributes(a.buf, r, source, at)
	if payload != nil {
		b = append(b, `,"datacontenttype":`...)
		b = appendJSONString(b, contentType)
		b = append(b, ceData...)
		if embedJSON {
			b = append(b, payload...)
		} else {
			b = appendJSONString(b, payload)
			r.textData = true
		}
	}
	b = append(b, '}')
	a.buf = b
	return b[start:len(b):len(b)]
}

// jsonMediaType reports whether data of this media type is embedded as
// JSON: application/json and text/json. The format's text also names
// */*+json, but the Go SDK (v2) reads data as JSON only for those two and
// refuses a +json type's embedded object, so such data goes as a string,
// which every reader takes.
func jsonMediaType(contentType []byte) bool {
	media := contentType
	if i := bytes.IndexByte(media, ';'); i >= 0 {
		media = media[:i]
	}
	media = bytes.TrimSpace(media)
	return bytes.EqualFold(media, ceJSON) || bytes.EqualFold(media, []byte("text/json"))
}

// takeString copies s into the arena.
func (a *arena) takeString(s string) []byte {
	start := len(a.buf)
	a.buf = append(a.buf, s...)
	return a.buf[start:len(a.buf):len(a.buf)]
}

// takeCETime copies PostgreSQL's timestamptz text in as RFC 3339, and
// refuses a value that is no RFC 3339 time (infinity, a year BC), which
// the time attribute must be. A value already in RFC 3339, as a replayed
// record stores it, is kept.
func (a *arena) takeCETime(pg []byte) ([]byte, error) {
	at := a.takeRFC3339(pg)
	if at[len(at)-1] == 'Z' && !bytes.Equal(at, pg) {
		return at, nil // converted from PostgreSQL's own UTC form
	}
	if _, err := time.Parse(time.RFC3339Nano, string(at)); err != nil {
		return nil, fmt.Errorf("occurred_at %q is no RFC 3339 time, which the CloudEvents time attribute must be", pg)
	}
	return at, nil
}

// appendJSONString appends s as a JSON string. Bytes that are not UTF-8
// become U+FFFD, so the value stays JSON whatever the column held.
func appendJSONString(dst, s []byte) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				dst = append(dst, '\\', c)
			case c == '\n':
				dst = append(dst, '\\', 'n')
			case c == '\r':
				dst = append(dst, '\\', 'r')
			case c == '\t':
				dst = append(dst, '\\', 't')
			case c < 0x20:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			default:
				dst = append(dst, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRune(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, `\ufffd`...)
		} else {
			dst = append(dst, s[i:i+size]...)
		}
		i += size
	}
	return append(dst, '"')
}

// appendStructuredAttributes appends a structured event's opening and
// its attributes but the data's, in the specification's order.
func appendStructuredAttributes(b []byte, r *Record, source, at []byte) []byte {
	b = append(b, `{"specversion":"1.0","id":`...)
	b = appendJSONString(b, r.EventID)
	b = append(b, `,"source":`...)
	b = appendJSONString(b, source)
	b = append(b, `,"type":`...)
	b = appendJSONString(b, r.EventType)
	if len(r.Key) > 0 {
		b = append(b, `,"subject":`...)
		b = appendJSONString(b, r.Key)
	}
	if at != nil {
		b = append(b, `,"time":`...)
		b = appendJSONString(b, at)
	}
	return b
}

// Store implements Shape. The header columns' values go into the stored
// headers, as in the router's shape.
func (CloudEvents) Store(ev *Event) Stored {
	s := Relay{}.Store(ev)
	s.PayloadNull = ev.Payload == nil
	if len(ev.Layout.HeaderColumns) > 0 {
		s.Headers = storedWithContentType(debeziumHeaders(ev), ev.ContentType)
	}
	return s
}

// StoreRecord implements Shape. The record carries no schema version, so
// none is stored; time is kept as the record has it, RFC 3339.
func (s CloudEvents) StoreRecord(r *Record) Stored {
	st := Stored{EventID: string(r.EventID), AggregateType: string(r.AggregateType), AggregateID: string(r.Key),
		EventType: string(r.EventType)}
	var own []Header
	for _, h := range r.Headers {
		if !layout.CloudEventsHeader(string(h.Key)) {
			own = append(own, h)
		}
	}
	st.Headers = string(headersObject(own))
	if !s.Structured {
		r.storedPayload(&st, r.Value)
		st.OccurredAt = string(r.Header("ce_time"))
		// The data's type as sent, which a replay sends again: it may
		// have come from the row (--column-content-type).
		st.Headers = storedWithContentType(st.Headers, r.Header(string(headerContentType)))
		return st
	}
	var attrs struct {
		Time            string `json:"time"`
		DataContentType string `json:"datacontenttype"`
	}
	_ = json.Unmarshal(r.Value, &attrs) // the relay built it: it is JSON
	st.OccurredAt = attrs.Time
	st.Headers = storedWithContentType(st.Headers, []byte(attrs.DataContentType))
	if r.binary {
		st.Payload, st.PayloadBinary = structuredBinaryData(r.Value), true
		return st
	}
	st.Payload, st.PayloadNull = structuredData(r.Value, r.textData)
	return st
}

// structuredData is the payload a structured event was built from: the
// data as it was embedded, or a text payload unquoted; null when the
// event has no data.
func structuredData(value []byte, text bool) (payload string, null bool) {
	i := bytes.Index(value, ceData)
	if i < 0 {
		return "", true
	}
	data := value[i+len(ceData) : len(value)-1]
	if !text {
		return string(data), false
	}
	var s string
	_ = json.Unmarshal(data, &s) // the relay quoted it
	return s, false
}

// structuredBinaryData is the payload of a structured event with
// data_base64, in bytea's text form.
func structuredBinaryData(value []byte) string {
	i := bytes.LastIndex(value, ceDataBase64)
	if i < 0 {
		return ""
	}
	raw, _ := base64.StdEncoding.AppendDecode(nil, value[i+len(ceDataBase64):len(value)-2]) // the relay encoded it
	return byteaText(raw)
}

// Restore implements Shape.
func (CloudEvents) Restore(s *Stored, l *layout.Layout) *Event {
	ev := Relay{}.Restore(s, l)
	if s.PayloadNull {
		ev.Payload = nil
	}
	if len(l.HeaderColumns) > 0 {
		ev.Extra, ev.Headers = splitDebeziumHeaders(s.Headers, l)
	}
	// The binding refuses a row's content-type header: a stored one is
	// the data's type the event was sent with (see Store, StoreRecord).
	ev.ContentType, ev.Headers = takeContentType(ev.Headers)
	return ev
}

// takeContentType removes content-type from a headers object and returns
// its value; headers without one come back as they are.
func takeContentType(headers []byte) (contentType, rest []byte) {
	if len(headers) == 0 {
		return nil, headers
	}
	members := map[string]json.RawMessage{}
	if json.Unmarshal(headers, &members) != nil {
		return nil, headers
	}
	raw, ok := members[string(headerContentType)]
	if !ok {
		return nil, headers
	}
	delete(members, string(headerContentType))
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return nil, headers
	}
	if len(members) > 0 {
		rest, _ = json.Marshal(members)
	}
	return []byte(s), rest
}

// CloudEventID is the id attribute of a structured CloudEvent, for readers
// of the records (reconcile) whose format carries the event id in the
// value rather than a header; false when value is no such event.
func CloudEventID(value []byte) ([]byte, bool) {
	var attrs struct {
		SpecVersion string `json:"specversion"`
		ID          string `json:"id"`
	}
	if err := json.Unmarshal(value, &attrs); err != nil || attrs.SpecVersion == "" || attrs.ID == "" {
		return nil, false
	}
	return []byte(attrs.ID), true
}

// errNoCloudEventsSource is Build's error for a layout with a CloudEvents
// format and no source, which Layout.SetRecordFormat refuses: no event
// without its required source attribute is ever sent.
var errNoCloudEventsSource = errors.New("the layout has a CloudEvents format and no source")
