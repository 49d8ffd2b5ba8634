package outbox

import (
	"strings"
	"testing"
)

// A hostile try of the writer found payloads that PostgreSQL refuses
// (numbers past numeric's range, 1e300000: the insert failed and the
// service's transaction was aborted) and one it changes without a word
// ({"a":1,"a":2} stored as {"a": 2}). Both are refused before anything is
// written; the limits are numeric's, found by trying them on PostgreSQL 15.
func TestCheckJSON(t *testing.T) {
	for doc, want := range map[string]string{
		`{"n": 1e131071}`:                    "",
		`{"n": 1.5e131071}`:                  "",
		`{"n": 1e-16383}`:                    "",
		`{"n": 0e-99999}`:                    "",
		`[1, 2.5, -3e10, {"a": [1e5]}]`:      "",
		`{"a": 1, "b": {"a": 2}, "c": "a"}`:  "",
		`{"n": 1e131072}`:                    "past what PostgreSQL's numeric holds",
		`{"n": 123e131070}`:                  "past what PostgreSQL's numeric holds",
		`{"n": 1e-16384}`:                    "past what PostgreSQL's numeric holds",
		`{"n": 0.1e-16383}`:                  "past what PostgreSQL's numeric holds",
		`[1e300000]`:                         "past what PostgreSQL's numeric holds",
		`{"a": 1, "a": 2}`:                   `member "a" twice`,
		`{"x": [{"b": 1, "c": {}, "b": 2}]}`: `member "b" twice`,
		`{"a": {"z": 1}, "b": {"z": 2}}`:     "",
	} {
		err := checkJSON([]byte(doc))
		switch {
		case want == "" && err != nil:
			t.Errorf("%s: %v, want accepted", doc, err)
		case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("%s: %v, want %q", doc, err, want)
		}
	}
}
