package event

import (
	"encoding/json"
	"fmt"

	"github.com/outbox-relay/outbox-relay/layout"
)

// Relay is the relay's own shape: key the aggregate id, value the
// payload, the six ReservedHeaders, then the row's headers column.
type Relay struct{}

var (
	headerEventID       = []byte("event_id")
	headerEventType     = []byte("event_type")
	headerAggregateType = []byte("aggregate_type")
	headerAggregateID   = []byte("aggregate_id")
	headerSchemaVersion = []byte("schema_version")
	headerOccurredAt    = []byte("occurred_at")
)

// Build implements Shape.
func (Relay) Build(ev *Event, r *Record) error {
	n := len(ev.EventID) + len(ev.AggregateType) + len(ev.AggregateID) + len(ev.EventType) +
		len(ev.SchemaVersion) + len(ev.OccurredAt) + len(ev.Payload)
	var extraInline [inlineHeaders - 6]Header
	extra, err := rowHeaders(ev.Headers, extraInline[:0])
	if err != nil {
		return err
	}
	contentType, err := configuredContentType(ev, extra)
	if err != nil {
		return err
	}
	n += len(contentType)
	for _, h := range extra {
		n += len(h.Key) + len(h.Value)
	}

	a := arena{buf: make([]byte, 0, n)}
	r.EventID = a.take(ev.EventID)
	r.Key = a.take(ev.AggregateID)
	if r.Value, err = a.payload(ev, r, false); err != nil {
		return err
	}
	r.EventType = a.take(ev.EventType)
	r.AggregateType = a.take(ev.AggregateType)
	headers := append(r.headers(plusContentType(6, contentType)+len(extra)),
		Header{Key: headerEventID, Value: r.EventID},
		Header{Key: headerEventType, Value: r.EventType},
		Header{Key: headerAggregateType, Value: r.AggregateType},
		Header{Key: headerAggregateID, Value: r.Key},
		Header{Key: headerSchemaVersion, Value: a.take(ev.SchemaVersion)},
		Header{Key: headerOccurredAt, Value: a.takeRFC3339(ev.OccurredAt)},
	)
	if contentType != nil {
		// Copied: a row's value aliases the caller's buffer.
		headers = append(headers, Header{Key: headerContentType, Value: a.take(contentType)})
	}
	for _, h := range extra {
		headers = append(headers, Header{Key: a.take(h.Key), Value: a.take(h.Value)})
	}
	r.Headers = headers
	return nil
}

// Store implements Shape. A --column-content-type value goes into the
// stored headers as content-type, which a replay sends as a row header.
func (Relay) Store(ev *Event) Stored {
	return Stored{
		EventID: string(ev.EventID), AggregateType: string(ev.AggregateType), AggregateID: string(ev.AggregateID),
		EventType: string(ev.EventType), SchemaVersion: string(ev.SchemaVersion), Payload: string(ev.Payload),
		PayloadBinary: ev.PayloadBinary, Headers: storedWithContentType(string(ev.Headers), ev.ContentType), OccurredAt: string(ev.OccurredAt),
	}
}

// storedWithContentType adds a row's content type to its stored headers (a
// JSON object, or empty), unless they set one already.
func storedWithContentType(headers string, contentType []byte) string {
	if len(contentType) == 0 {
		return headers
	}
	members := map[string]json.RawMessage{}
	if headers != "" && json.Unmarshal([]byte(headers), &members) != nil {
		// Not an object: the error the event was quarantined with says so.
		return headers
	}
	if _, ok := members[string(headerContentType)]; ok {
		return headers
	}
	members[string(headerContentType)], _ = json.Marshal(string(contentType))
	b, _ := json.Marshal(members)
	return string(b)
}

// StoreRecord implements Shape. occurred_at is kept as the header has it,
// RFC 3339, which a replay sends as it is.
func (Relay) StoreRecord(r *Record) Stored {
	s := Stored{
		EventID: string(r.EventID), AggregateType: string(r.AggregateType), AggregateID: string(r.Key),
		EventType: string(r.EventType), SchemaVersion: string(r.Header("schema_version")),
		Headers: string(headersObject(r.ownHeaders(len(ReservedHeaders)))), OccurredAt: string(r.Header("occurred_at")),
	}
	r.storedPayload(&s, r.Value)
	return s
}

// configuredContentType is the content-type header's value for ev's
// record: the row's --column-content-type value, else --content-type's;
// nil when neither is set or the row's headers set their own, which wins
// as every row header does. A row's value that is no media type is an
// error, so the event is quarantined rather than sent with a type its
// readers refuse.
func configuredContentType(ev *Event, rowHeaders []Header) ([]byte, error) {
	if ev.Layout == nil || ev.Layout.ContentType == "" && len(ev.ContentType) == 0 {
		return nil, nil
	}
	for _, h := range rowHeaders {
		if string(h.Key) == string(headerContentType) {
			return nil, nil
		}
	}
	if len(ev.ContentType) > 0 {
		return ev.ContentType, rowContentTypeProblem(ev.ContentType)
	}
	return ev.Layout.ContentTypeBytes(), nil
}

// rowContentTypeProblem checks a row's --column-content-type value, which
// --content-type's own check never saw.
func rowContentTypeProblem(contentType []byte) error {
	if !layout.ValidMediaType(contentType) {
		return fmt.Errorf("the content-type column holds %q, which is not a media type such as application/json or application/x-protobuf (RFC 9110)", contentType)
	}
	return nil
}

// plusContentType is n headers of a shape's own, plus one for a
// configured content-type: a record asks room for what it sends, so the
// common one fits the record's inline array.
func plusContentType(n int, contentType []byte) int {
	if contentType != nil {
		n++
	}
	return n
}

// ownHeaders are the headers a shape placed after its own first n: the
// row's, less the configured content-type, which a replay adds again.
func (r *Record) ownHeaders(n int) []Header {
	rest := r.Headers[n:]
	if r.layout != nil && r.layout.ContentType != "" && len(rest) > 0 &&
		string(rest[0].Key) == string(headerContentType) && string(rest[0].Value) == r.layout.ContentType {
		rest = rest[1:]
	}
	return rest
}

// Restore implements Shape.
func (Relay) Restore(s *Stored, l *layout.Layout) *Event {
	ev := &Event{
		EventID: []byte(s.EventID), AggregateType: []byte(s.AggregateType), AggregateID: []byte(s.AggregateID),
		EventType: []byte(s.EventType), SchemaVersion: []byte(s.SchemaVersion), Payload: []byte(s.Payload),
		PayloadBinary: s.PayloadBinary, OccurredAt: []byte(s.OccurredAt), Layout: l,
	}
	if s.Headers != "" {
		ev.Headers = []byte(s.Headers)
	}
	return ev
}

// headersObject is headers as a JSON object, a null value as null; nil
// when there are none.
func headersObject(headers []Header) []byte {
	if len(headers) == 0 {
		return nil
	}
	obj := make(map[string]*string, len(headers))
	for _, h := range headers {
		if h.Value == nil {
			obj[string(h.Key)] = nil
			continue
		}
		v := string(h.Value)
		obj[string(h.Key)] = &v
	}
	b, _ := json.Marshal(obj)
	return b
}
