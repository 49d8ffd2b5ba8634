package event

import (
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"testing"
)

// FuzzRowHeaders holds the hand-written headers scanner (rowHeaders) to
// encoding/json: for any input both accept or both reject, and on accept
// they agree on every key and value, in object order. The scanner differs
// from encoding/json on purpose in three ways, which the reference below
// reproduces:
//   - an empty or all-whitespace column means no headers (encoding/json
//     rejects empty input);
//   - a reserved header name is refused (encoding/json has no such rule);
//   - duplicate keys are all kept, in order (encoding/json keeps the last).
//
// Non-string values are kept as JSON text, so they are compared by what
// they decode to, not byte for byte.
func FuzzRowHeaders(f *testing.F) {
	for _, seed := range []string{
		`{"tenant": "acme", "n": 1.5e3, "ok": true, "none": null, "nested": {"a": [1, {"b": "}"}]}, "esc": "q\"uote\\n\u00e9"}`,
		`{"a":"b","c":[]}`,
		" \n{ \"sp ace\" :\t\"v\" } ",
		`{}`,
		`{"emoji": "🚀", "empty": ""}`,
		`{"tenant": "t1", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`,
		`{"a": 1, "a": "2"}`,
		`{"event_id": "x"}`,
		`null`,
		``,
		`{"a": }`, `{"a" 1}`, `{"a": 1,}`, `{"a": "x"`, `{"a": 1} x`, `{"a": tru}`, `[1]`, `"s"`,
		`{"a": "\ud83d\ude80"}`, `{"a": [1, 2}`, `{"a": {"b": 1}, "c": -0.5e-3}`,
		// Found by this fuzzer: a panic on an unterminated value, trailing
		// bytes after an empty object, a raw control character, bytes that
		// are not UTF-8, and space after null or a value.
		`{"":{`, `{}0`, "{\"\x00\":\"\"}", "{\"\xff\":\"\"}", `null `, `{"a": 1 }`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, gotErr := rowHeaders(raw, nil)
		want, wantErr := referenceHeaders(raw)
		if (gotErr == nil) != (wantErr == nil) {
			t.Fatalf("input %q: scanner error %v, encoding/json error %v", raw, gotErr, wantErr)
		}
		if gotErr != nil {
			return
		}
		if len(got) != len(want) {
			t.Fatalf("input %q: scanner found %d headers %q, encoding/json %d", raw, len(got), got, len(want))
		}
		for i, h := range got {
			w := want[i]
			if string(h.Key) != w.key {
				t.Fatalf("input %q: header %d key %q, encoding/json %q", raw, i, h.Key, w.key)
			}
			if err := sameHeaderValue(h.Value, w.value); err != nil {
				t.Fatalf("input %q: header %q: %v", raw, w.key, err)
			}
		}
	})
}

// referenceHeader is one member of the headers object as encoding/json
// reads it.
type referenceHeader struct {
	key   string
	value json.RawMessage
}

// referenceHeaders reads raw with encoding/json under the scanner's
// documented rules: it returns the object's members in order, duplicates
// included.
func referenceHeaders(raw []byte) ([]referenceHeader, error) {
	if len(bytes.Trim(raw, " \t\r\n")) == 0 {
		return nil, nil
	}
	if !json.Valid(raw) {
		return nil, fmt.Errorf("invalid JSON")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	first, err := dec.Token()
	if err != nil {
		return nil, err
	}
	if first == nil {
		return nil, nil // JSON null: no headers
	}
	if first != json.Delim('{') {
		return nil, fmt.Errorf("not an object")
	}
	var out []referenceHeader
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key := tok.(string) // json.Valid held, so a key comes here
		if slices.Contains(ReservedHeaders, key) {
			return nil, fmt.Errorf("reserved header %q", key)
		}
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return nil, err
		}
		out = append(out, referenceHeader{key: key, value: value})
	}
	return out, nil
}

// sameHeaderValue reports how the scanner's header value differs from the
// member encoding/json read, or nil: JSON null is a nil value, a string is
// its decoded content, anything else is JSON text decoding to the same.
func sameHeaderValue(got []byte, want json.RawMessage) error {
	if string(want) == "null" {
		if got != nil {
			return fmt.Errorf("value %q, want a null value", got)
		}
		return nil
	}
	if got == nil {
		return fmt.Errorf("null value, want %s", want)
	}
	var s string
	if json.Unmarshal(want, &s) == nil {
		if string(got) != s {
			return fmt.Errorf("value %q, want %q", got, s)
		}
		return nil
	}
	a, errA := decodeNumbersAsText(got)
	b, errB := decodeNumbersAsText(want)
	if errA != nil || errB != nil || !reflect.DeepEqual(a, b) {
		return fmt.Errorf("value %s (%v), want %s", got, errA, want)
	}
	return nil
}

// decodeNumbersAsText decodes one JSON value keeping numbers as written, so
// 1.0 and 1 stay different as they do on the wire.
func decodeNumbersAsText(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, fmt.Errorf("more than one JSON value in %q", b)
	}
	return v, nil
}
