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
	if got, want := Relay.SelectList(all, quoteForTest), `"event_id"::text, "aggregate_type", "aggregate_id", "event_type", "schema_version"::text, "payload"::text, "headers"::text, "occurred_at"::text, NULL::text`; got != want {
		t.Errorf("relay layout:\n got %s\nwant %s", got, want)
	}
	l, err := New(NameDebezium, [NumColumns]string{}, "tenant, type:eventType")
	if err != nil {
		t.Fatal(err)
	}
	present := map[string]bool{"id": true, "aggregatetype": true, "aggregateid": true, "payload": true, "tenant": true}
	got := l.SelectList(present, quoteForTest)
	want := `"id"::text, "aggregatetype", "aggregateid", NULL::text, NULL::text, "payload"::text, NULL::text, NULL::text, NULL::text, "tenant"::text, "type"::text`
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

// Issue 40.7: an optional column the table lacks is read as NULL, but one a
// flag names is a typo, which would drop the field from every record.
func TestColumnNamedByAFlagMustExist(t *testing.T) {
	minimal := map[string]string{"event_id": "uuid", "aggregate_type": "text", "aggregate_id": "text", "event_type": "text", "payload": "jsonb"}
	l, err := New(NameRelay, [NumColumns]string{Headers: "hdrs_typo"}, "")
	if err != nil {
		t.Fatal(err)
	}
	if p := strings.Join(l.ColumnProblems(minimal), "; "); !strings.Contains(p, "column hdrs_typo (--column-headers) is missing") {
		t.Errorf("problems %q do not name the flag's missing column", p)
	}
	missing := l.MissingNamedColumns(func(c string) bool { _, ok := minimal[c]; return ok })
	if len(missing) != 1 || missing[0] != "hdrs_typo (--column-headers)" {
		t.Errorf("MissingNamedColumns = %q, want the one column the flag names", missing)
	}
	if m := Relay.MissingNamedColumns(func(string) bool { return false }); len(m) != 0 {
		t.Errorf("the relay's own layout names no column by flag, yet %q", m)
	}
}

// --record-format is chosen apart from the table: each layout defaults to
// its own format, a CloudEvents format needs a valid source and any other
// refuses one, and what depends on the records (the event id's header,
// whether the event type is required) follows the format.
func TestRecordFormat(t *testing.T) {
	for _, tc := range []struct {
		table, format, source string
		want                  Format
		idHeader              string
		typeRequired          bool
	}{
		{NameRelay, "", "", FormatRelay, "event_id", true},
		{NameDebezium, "", "", FormatDebezium, "id", false},
		{NameRelay, FormatNameDebezium, "", FormatDebezium, "id", false},
		{NameRelay, FormatNameCloudEvents, "https://example.com/billing", FormatCloudEvents, "ce_id", true},
		{NameDebezium, FormatNameCloudEventsStructured, "/billing/outbox?x=1#f", FormatCloudEventsStructured, "", true},
		{NameDebezium, FormatNameCloudEvents, "urn:uuid:6e8bc430-9c3a-11d9-9669-0800200c9a66", FormatCloudEvents, "ce_id", true},
	} {
		l, err := New(tc.table, [NumColumns]string{}, "")
		if err != nil {
			t.Fatal(err)
		}
		if err := l.SetRecordFormat(tc.format, tc.source); err != nil {
			t.Errorf("%s table, format %q: %v", tc.table, tc.format, err)
			continue
		}
		if l.RecordFormat() != tc.want || l.EventIDHeader() != tc.idHeader || l.EventTypeRequired() != tc.typeRequired ||
			l.Required(EventType) != (tc.typeRequired || tc.table == NameRelay) || l.CloudEventsSource != tc.source {
			t.Errorf("%s table, format %q: format %s, id header %q, type required %v/%v, source %q", tc.table, tc.format,
				l.RecordFormat(), l.EventIDHeader(), l.EventTypeRequired(), l.Required(EventType), l.CloudEventsSource)
		}
	}
	for _, tc := range []struct{ table, format, headerColumns, source, want string }{
		{NameRelay, "avro", "", "", `--record-format "avro": use relay`},
		{NameRelay, FormatNameCloudEvents, "", "", "the CloudEvents formats need a source"},
		{NameRelay, FormatNameCloudEventsStructured, "", "https://example.com/a b", `byte ' ' at offset 21`},
		{NameRelay, FormatNameCloudEvents, "", "/billing/caf\u00e9", "is not allowed in a URI reference"},
		{NameRelay, FormatNameCloudEvents, "", "/billing%2", "percent escape"},
		{NameRelay, "", "", "/billing", "--cloudevents-source \"/billing\" is set but --record-format is relay"},
		{NameDebezium, FormatNameRelay, "tenant", "", "--header-columns with --record-format relay"},
		{NameDebezium, FormatNameCloudEvents, "tenant:content-type", "/billing", `header "content-type" would clash`},
	} {
		l, err := New(tc.table, [NumColumns]string{}, tc.headerColumns)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.SetRecordFormat(tc.format, tc.source); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s table, format %q, source %q: %v, want %q", tc.table, tc.format, tc.source, err, tc.want)
		}
	}
}

// An occurred_at without a zone has no offset in its text, so it can
// never be the CloudEvents time attribute; the column check says so at
// start-up instead of every event being refused.
func TestCloudEventsNeedOccurredAtWithZone(t *testing.T) {
	l, err := New(NameRelay, [NumColumns]string{}, "")
	if err != nil {
		t.Fatal(err)
	}
	found := map[string]string{"event_id": "uuid", "aggregate_type": "text", "aggregate_id": "text", "event_type": "text", "payload": "jsonb",
		"occurred_at": "timestamp without time zone"}
	if p := l.ColumnProblems(found); len(p) != 0 {
		t.Errorf("relay records: %q", p)
	}
	if err := l.SetRecordFormat(FormatNameCloudEvents, "/billing"); err != nil {
		t.Fatal(err)
	}
	if p := strings.Join(l.ColumnProblems(found), "; "); !strings.Contains(p, "want timestamp with time zone for --record-format cloudevents") {
		t.Errorf("cloudevents records: %q", p)
	}
}

// A bytea payload passes the column check (its records carry the bytes);
// --content-type takes a media type and nothing a header could not hold,
// and refuses a header column that fills the same header.
func TestBinaryPayloadAndContentType(t *testing.T) {
	found := map[string]string{"event_id": "uuid", "aggregate_type": "text", "aggregate_id": "text", "event_type": "text", "payload": "bytea"}
	if p := Relay.ColumnProblems(found); len(p) != 0 {
		t.Errorf("bytea payload: %q", p)
	}
	l, err := New(NameRelay, [NumColumns]string{}, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"protobuf", "application/x-protobuf\r\nx: y", "a/b; c"} {
		if err := l.SetContentType(bad); err == nil || !strings.Contains(err.Error(), "--content-type") {
			t.Errorf("%q: %v", bad, err)
		}
	}
	if err := l.SetContentType("application/x-protobuf; messageType=acme.Order"); err != nil || string(l.ContentTypeBytes()) != l.ContentType {
		t.Errorf("%v, %q", err, l.ContentTypeBytes())
	}
	d, err := New(NameDebezium, [NumColumns]string{}, "ct:Content-Type")
	if err != nil {
		t.Fatal(err)
	}
	if err := d.SetContentType("application/x-protobuf"); err == nil || !strings.Contains(err.Error(), "header column ct") {
		t.Errorf("a header column fills content-type: %v", err)
	}
}

func TestValidMediaType(t *testing.T) {
	for s, want := range map[string]bool{
		"application/json":                    true,
		"application/vnd.acme+json; v=2":      true,
		`text/plain; charset="utf-8"`:         true,
		"text/plain;charset=utf-8;":           true,
		"application/x-protobuf":              true,
		"bad type!!":                          false,
		"application":                         false,
		"application/":                        false,
		"/json":                               false,
		"application/json; charset":           false,
		"application/json\r\nx-evil: 1":       false,
		`text/plain; charset="utf-8`:          false,
		"application/json extra":              false,
		"":                                    false,
		"application/json; a=b; c=\"d\\\"e\"": true,
	} {
		if got := ValidMediaType([]byte(s)); got != want {
			t.Errorf("ValidMediaType(%q) = %v, want %v", s, got, want)
		}
	}
}

// Issue 40.8: 'http://[::1' passed the byte check, and every record was
// then one the CloudEvents SDK could not read.
func TestCloudEventsSourceMustParse(t *testing.T) {
	for _, source := range []string{"http://[::1", "http://%zz", "a#b#c"} {
		if err := ValidCloudEventsSource(source); err == nil {
			t.Errorf("source %q accepted", source)
		}
	}
	for _, source := range []string{"https://example.com/billing", "/billing/outbox", "urn:acme:billing", "http://[::1]:8080/x"} {
		if err := ValidCloudEventsSource(source); err != nil {
			t.Errorf("source %q refused: %v", source, err)
		}
	}
	l, err := New(NameRelay, [NumColumns]string{}, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := l.SetRecordFormat(FormatNameCloudEvents, "/billing"); err != nil {
		t.Fatal(err)
	}
	if err := l.SetContentType("application/cloudevents+json"); err == nil {
		t.Error("--content-type application/cloudevents+json accepted for CloudEvents' data")
	}
}
