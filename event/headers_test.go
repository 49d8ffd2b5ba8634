package event

import (
	"encoding/json"
	"fmt"
	"testing"
)

// The scanner must agree with encoding/json on every object it accepts.
func TestRowHeadersMatchEncodingJSON(t *testing.T) {
	for _, raw := range []string{
		`{"tenant": "acme", "n": 1.5e3, "ok": true, "none": null, "nested": {"a": [1, {"b": "}"}]}, "esc": "q\"uote\\n\u00e9"}`,
		`{"a":"b","c":[]}`,
		" \n{ \"sp ace\" :\t\"v\" } ",
		`{}`,
		`{"emoji": "🚀", "empty": ""}`,
	} {
		got, err := rowHeaders([]byte(raw), nil)
		if err != nil {
			t.Fatalf("%s: %v", raw, err)
		}
		var want map[string]json.RawMessage
		if err := json.Unmarshal([]byte(raw), &want); err != nil {
			t.Fatal(err)
		}
		if len(got) != len(want) {
			t.Fatalf("%s: %d headers, want %d", raw, len(got), len(want))
		}
		for _, h := range got {
			w := want[string(h.Key)]
			var s string
			switch {
			case string(w) == "null":
				if h.Value != nil {
					t.Errorf("%s: %s = %q, want a null value", raw, h.Key, h.Value)
				}
			case json.Unmarshal(w, &s) == nil:
				if string(h.Value) != s {
					t.Errorf("%s: %s = %q, want %q", raw, h.Key, h.Value, s)
				}
			default:
				var a, b any
				if json.Unmarshal(h.Value, &a) != nil || json.Unmarshal(w, &b) != nil || fmt.Sprint(a) != fmt.Sprint(b) {
					t.Errorf("%s: %s = %s, want %s", raw, h.Key, h.Value, w)
				}
			}
		}
	}
	for _, bad := range []string{`{"a": }`, `{"a" 1}`, `{"a": 1,}`, `{"a": "x"`, `{"a": 1} x`, `{"a": tru}`, `[1]`, `"s"`} {
		if _, err := rowHeaders([]byte(bad), nil); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

func TestRFC3339(t *testing.T) {
	for in, want := range map[string]string{
		"2026-11-29 21:03:56.123456+00": "2026-11-29T21:03:56.123456Z",
		"2026-11-29 21:03:56+00":        "2026-11-29T21:03:56Z",
		"infinity":                      "infinity",
		"2026-11-29 21:03:56+05:30":     "2026-11-29 21:03:56+05:30",
	} {
		if got := string(appendRFC3339(nil, []byte(in))); got != want {
			t.Errorf("appendRFC3339(%q) = %q, want %q", in, got, want)
		}
	}
}
