package layout

import (
	"strings"
	"testing"
)

func quoteForTest(s string) string { return `"` + s + `"` }

// The SELECT list reads the fields in Field order in the stream's text
// forms, NULL for a column the layout does not read or an optional one the
// table lacks, then the header columns; the relay's own list is what
// reconcile has always read.
func TestSelectList(t *testing.T) {
	all := map[string]bool{}
	for _, c := range []string{"event_id", "aggregate_type", "aggregate_id", "event_type", "schema_version", "payload", "headers", "occurred_at"} {
		all[c] = true
	}
	if got, want := Relay.SelectList(all, quoteForTest), `"event_id"::text, "aggregate_type", "aggregate_id", "event_type", "schema_version"::text, "payload"::text, "headers"::text, "occurred_at"::text`; got != want {
		t.Errorf("relay layout:\n got %s\nwant %s", got, want)
	}
	l, err := New(NameDebezium, [NumColumns]string{}, "tenant, type:eventType")
	if err != nil {
		t.Fatal(err)
	}
	present := map[string]bool{"id": true, "aggregatetype": true, "aggregateid": true, "payload": true, "tenant": true}
	got := l.SelectList(present, quoteForTest)
	want := `"id"::text, "aggregatetype", "aggregateid", NULL::text, NULL::text, "payload"::text, NULL::text, NULL::text, "tenant"::text, "type"::text`
	if got != want {
		t.Errorf("debezium layout:\n got %s\nwant %s", got, want)
	}
}

// Column checks name the mapped column and its flag, and a missing header
// column, as the router's table.fields.additional.error.on.missing does.
func TestColumnProblemsNameTheFlag(t *testing.T) {
	l, err := New(NameDebezium, [NumColumns]string{AggregateID: "agg"}, "tenant")
	if err != nil {
		t.Fatal(err)
	}
	problems := strings.Join(l.ColumnProblems(map[string]string{
		"id": "uuid", "aggregatetype": "character varying", "agg": "bigint", "payload": "jsonb",
	}), "; ")
	for _, want := range []string{"column agg (--column-aggregate-id) is bigint", "column tenant (--header-columns) is missing"} {
		if !strings.Contains(problems, want) {
			t.Errorf("problems %q lack %q", problems, want)
		}
	}
	if p := Relay.ColumnProblems(map[string]string{"event_id": "uuid", "aggregate_type": "text", "aggregate_id": "text", "event_type": "text", "payload": "jsonb"}); len(p) != 0 {
		t.Errorf("the relay's own minimal table has problems: %q", p)
	}
}
