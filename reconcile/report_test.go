package reconcile

import (
	"encoding/json"
	"strings"
	"testing"
)

// Issue 24.15: `reconcile --json` printed null for an empty list; a script
// iterating over missing ids then needed a check.
func TestReportJSONHasNoNullLists(t *testing.T) {
	raw, err := json.Marshal(&Report{})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(raw), "null") {
		t.Errorf("empty report: %s", raw)
	}
	for _, key := range []string{`"missing":[]`, `"phantoms":[]`, `"republish_failed":[]`} {
		if !strings.Contains(string(raw), key) {
			t.Errorf("no %s in %s", key, raw)
		}
	}
}
