package inbox

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/outbox"
)

// Header is one Kafka record header, as any client hands it over.
type Header struct {
	Key, Value []byte
}

// Event is one record from the relay, as the inbox and a handler see it,
// whichever record format the relay wrote (see ParseRecord).
type Event struct {
	ID            string // the event id: event_id, ce_id or id
	AggregateType string // empty for a CloudEvent or a Debezium-shape record, which carry none
	AggregateID   string
	EventType     string
	// Version is the aggregate_version header; 0 when the record has none.
	Version int64
	// Payload is the record's value, or a structured CloudEvent's data:
	// JSON, text, or the bytes of a bytea payload (Protobuf, Avro) as they
	// were written, never re-encoded.
	Payload []byte
	// Headers holds every header of the record, the relay's own included;
	// content-type, when the writer or the relay's --content-type set one,
	// says how to read a binary Payload (for a structured CloudEvent, it is
	// the event's datacontenttype).
	Headers map[string]string
}

// VersionHeader is the header the writer (package outbox) puts the
// aggregate's version in.
const VersionHeader = outbox.VersionHeader

// ErrNoEventID means a record carries no event id in any of the relay's
// record formats: it did not come from the relay, and the inbox cannot
// tell a re-delivery of it.
var ErrNoEventID = errors.New("record has no event id (no event_id, ce_id or id header, and no structured CloudEvent): it did not come from the relay")

// Parse reads a record's headers and value into an Event; it is
// ParseRecord without the key, which only a Debezium-shape record needs
// (for its aggregate id).
func Parse(headers []Header, value []byte) (Event, error) {
	return ParseRecord(nil, headers, value)
}

// ParseRecord reads a record from the relay into an Event, in each of the
// relay's record formats, told apart by their headers:
//
//   - relay (the default): event_id, event_type, aggregate_type and
//     aggregate_id headers; the value is the payload.
//   - cloudevents (binary content mode): ce_id, ce_type and ce_subject (the
//     aggregate id); the value is the payload.
//   - cloudevents-structured: content-type application/cloudevents+json;
//     the value is the event in JSON, whose data (or data_base64) is the
//     payload.
//   - debezium: id; the key is the aggregate id, and the event type is a
//     header named type or eventType if the relay placed one there with
//     --header-columns.
//
// In every format the version is the aggregate_version header, which the
// relay passes through as the writer set it. Any Kafka client works: pass
// its key, headers and value.
//
// A record it refuses can never be read, however often it is tried: no
// event id, a version that is no positive integer, a structured CloudEvent
// that is no JSON, or an id or type with a NUL byte or bytes that are not
// UTF-8. Both adapters set such a record aside (Records.Raw) so its
// partition goes on.
func ParseRecord(key []byte, headers []Header, value []byte) (Event, error) {
	ev := Event{Payload: value, Headers: make(map[string]string, len(headers))}
	for _, h := range headers {
		ev.Headers[string(h.Key)] = string(h.Value)
	}
	switch {
	case ev.Headers["event_id"] != "":
		ev.ID = ev.Headers["event_id"]
		ev.AggregateType = ev.Headers["aggregate_type"]
		ev.AggregateID = ev.Headers["aggregate_id"]
		ev.EventType = ev.Headers["event_type"]
	case ev.Headers["ce_specversion"] != "":
		ev.ID = ev.Headers["ce_id"]
		ev.AggregateID = ev.Headers["ce_subject"]
		ev.EventType = ev.Headers["ce_type"]
	case isStructuredCloudEvent(ev.Headers["content-type"]):
		if err := parseStructured(&ev, value); err != nil {
			return Event{}, err
		}
	case ev.Headers["id"] != "":
		ev.ID = ev.Headers["id"]
		ev.AggregateID = string(key)
		ev.EventType = ev.Headers["type"]
		if ev.EventType == "" {
			ev.EventType = ev.Headers["eventType"]
		}
	}
	if ev.ID == "" {
		return Event{}, ErrNoEventID
	}
	for _, f := range [...]struct{ name, value string }{
		{"event id", ev.ID}, {"aggregate type", ev.AggregateType}, {"aggregate id", ev.AggregateID}, {"event type", ev.EventType},
	} {
		if strings.ContainsRune(f.value, 0) || !utf8.ValidString(f.value) {
			return Event{}, fmt.Errorf("record's %s %q holds a NUL byte or bytes that are not UTF-8, which the inbox's text columns cannot store", f.name, f.value)
		}
	}
	if v, ok := ev.Headers[VersionHeader]; ok {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 {
			return Event{}, fmt.Errorf("event %s: header %s is %q, want a positive integer", ev.ID, VersionHeader, v)
		}
		ev.Version = n
		if ev.AggregateID == "" {
			// A version orders one aggregate's events: without the
			// aggregate, every such record would share one sequence and
			// all but the first of each number would count as stale.
			return Event{}, fmt.Errorf("event %s: header %s is %d, but the record names no aggregate id (aggregate_id header, ce_subject, or the key)", ev.ID, VersionHeader, n)
		}
	}
	return ev, nil
}

// isStructuredCloudEvent: the binding's media type, with or without
// parameters.
func isStructuredCloudEvent(contentType string) bool {
	mediaType, _, _ := strings.Cut(contentType, ";")
	return strings.EqualFold(strings.TrimSpace(mediaType), "application/cloudevents+json")
}

// parseStructured takes the attributes and the data of a structured
// CloudEvent, by the JSON format's rules: data_base64 holds bytes; data
// holds JSON as it is when the data's type is JSON (or unset), and
// otherwise a string whose text is the data. Each string attribute also
// goes into Headers as binary mode's ce_ header would carry it (ce_time,
// ce_source, extensions), unless the record has that header itself, so a
// handler reads both modes the same way.
func parseStructured(ev *Event, value []byte) error {
	var members map[string]json.RawMessage
	if err := json.Unmarshal(value, &members); err != nil {
		return fmt.Errorf("structured cloudevent is no JSON object: %w", err)
	}
	attributes := make(map[string]string, len(members))
	for name, raw := range members {
		var text string
		if name != "data" && json.Unmarshal(raw, &text) == nil {
			attributes[name] = text
		}
	}
	if attributes["specversion"] == "" || attributes["id"] == "" {
		return fmt.Errorf("structured cloudevent lacks specversion or id: %w", ErrNoEventID)
	}
	ev.ID, ev.AggregateID, ev.EventType = attributes["id"], attributes["subject"], attributes["type"]
	for name, text := range attributes {
		if _, set := ev.Headers["ce_"+name]; !set && name != "data_base64" && name != "datacontenttype" {
			ev.Headers["ce_"+name] = text
		}
	}
	contentType := attributes["datacontenttype"]
	if contentType != "" {
		ev.Headers["content-type"] = contentType
	}
	data := members["data"]
	_, binary := members["data_base64"]
	switch {
	case binary:
		text, isText := attributes["data_base64"]
		raw, err := base64.StdEncoding.DecodeString(text)
		if !isText || err != nil {
			return fmt.Errorf("event %s: data_base64 is no base64 string", ev.ID)
		}
		ev.Payload = raw
	case data == nil || string(data) == "null":
		ev.Payload = nil
	case isJSONMediaType(contentType) || data[0] != '"':
		ev.Payload = []byte(data)
	default:
		var text string
		if err := json.Unmarshal(data, &text); err != nil {
			return fmt.Errorf("event %s: data: %w", ev.ID, err)
		}
		ev.Payload = []byte(text)
	}
	return nil
}

// isJSONMediaType: unset (the format's default), application/json, or a
// +json suffix.
func isJSONMediaType(contentType string) bool {
	mediaType, _, _ := strings.Cut(contentType, ";")
	mediaType = strings.ToLower(strings.TrimSpace(mediaType))
	return mediaType == "" || mediaType == "application/json" || mediaType == "text/json" || strings.HasSuffix(mediaType, "+json")
}
