package event

import (
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"
)

// ReservedHeaders are the headers every record of the relay's shape
// carries. A row's own headers may not use these names, in any shape.
var ReservedHeaders = []string{"event_id", "event_type", "aggregate_type", "aggregate_id", "schema_version", "occurred_at"}

// rowHeaders reads the row's headers column, a JSON object, into dst:
// string values become header values as they are, other values are kept as
// JSON text, and JSON null becomes a null header value. Object order is kept.
// The result aliases raw unless a string holds escapes; a hand-written
// scanner keeps a row with headers from costing dozens of allocations.
func rowHeaders(raw []byte, dst []Header) ([]Header, error) {
	i := skipSpace(raw, 0)
	if i == len(raw) || string(trimSpaceRight(raw[i:])) == "null" {
		return dst, nil
	}
	if raw[i] != '{' {
		return nil, errors.New("headers column is not a JSON object")
	}
	i = skipSpace(raw, i+1)
	if i < len(raw) && raw[i] == '}' {
		if skipSpace(raw, i+1) != len(raw) {
			return nil, fmt.Errorf("headers column: malformed JSON object at offset %d", i+1)
		}
		return dst, nil
	}
	for {
		if i >= len(raw) || raw[i] != '"' {
			return nil, fmt.Errorf("headers column: expected a key at offset %d", i)
		}
		key, next, err := jsonString(raw, i)
		if err != nil {
			return nil, fmt.Errorf("headers column: %w", err)
		}
		for _, reserved := range ReservedHeaders {
			if string(key) == reserved {
				return nil, fmt.Errorf("headers column sets reserved header %q", key)
			}
		}
		i = skipSpace(raw, next)
		if i >= len(raw) || raw[i] != ':' {
			return nil, fmt.Errorf("headers column, key %q: expected ':'", key)
		}
		i = skipSpace(raw, i+1)
		var value []byte
		switch {
		case i < len(raw) && raw[i] == '"':
			value, next, err = jsonString(raw, i)
		case len(raw)-i >= 4 && string(raw[i:i+4]) == "null":
			value, next = nil, i+4
		default:
			next, err = jsonValueEnd(raw, i)
			if err == nil {
				// The value as written, without the space before the next
				// comma or brace.
				value = trimSpaceRight(raw[i:next])
			}
		}
		if err != nil {
			return nil, fmt.Errorf("headers column, key %q: %w", key, err)
		}
		dst = append(dst, Header{Key: key, Value: value})
		i = skipSpace(raw, next)
		if i < len(raw) && raw[i] == ',' {
			i = skipSpace(raw, i+1)
			continue
		}
		if i < len(raw) && raw[i] == '}' && skipSpace(raw, i+1) == len(raw) {
			return dst, nil
		}
		return nil, fmt.Errorf("headers column: malformed JSON object at offset %d", i)
	}
}

func trimSpaceRight(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t' || b[len(b)-1] == '\n' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	return b
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// jsonString reads the string starting at b[i] (a quote) and returns its
// content and the offset after its closing quote. A string with escapes or
// bytes that are not UTF-8 goes through encoding/json, so both forms of the
// same text give the same header.
func jsonString(b []byte, i int) (content []byte, next int, err error) {
	slow := false
	for j := i + 1; j < len(b); j++ {
		switch c := b[j]; {
		case c == '\\':
			slow = true
			j++
		case c < 0x20:
			return nil, 0, fmt.Errorf("control character %#x in a string", c)
		case c >= utf8.RuneSelf:
			slow = true
		case c == '"':
			if !slow {
				return b[i+1 : j], j + 1, nil
			}
			var s string
			if err := json.Unmarshal(b[i:j+1], &s); err != nil {
				return nil, 0, err
			}
			return []byte(s), j + 1, nil
		}
	}
	return nil, 0, errors.New("unterminated string")
}

// jsonValueEnd returns the offset just after the number, literal, object or
// array starting at b[i].
func jsonValueEnd(b []byte, i int) (int, error) {
	depth := 0
	for j := i; j < len(b); j++ {
		switch c := b[j]; c {
		case '"':
			_, next, err := jsonString(b, j)
			if err != nil {
				return 0, err
			}
			j = next - 1
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return j, validJSON(b[i:j])
			}
			depth--
			if depth == 0 {
				return j + 1, validJSON(b[i : j+1])
			}
		case ',':
			if depth == 0 {
				return j, validJSON(b[i:j])
			}
		}
	}
	if depth == 0 {
		return len(b), validJSON(b[i:])
	}
	return 0, errors.New("unterminated value")
}

func validJSON(v []byte) error {
	if !json.Valid(v) {
		return fmt.Errorf("invalid JSON value %q", v)
	}
	return nil
}
