package pg

import (
	"strings"
	"testing"
)

// A password that is also an ordinary word must neither garble the message
// nor be given away by the garbling: masking works on the DSN's structure,
// never on the password's value.
func TestRedactErrorKeepsWordsThatContainThePassword(t *testing.T) {
	for _, tc := range []struct{ dsn, password string }{
		{"host=db user=app password=app dbname=app", "app"},
		{"postgres://app:app@db:5432/app", "app"},
		{"host=db user=relay password=a dbname=app", "a"},
		{"postgres://relay:a@db/app", "a"},
	} {
		msg := `connect to host=db user=app dbname=app: precondition failed: FATAL: password authentication failed for user "app" (SQLSTATE 28P01)`
		if got := RedactError(msg, tc.dsn); got != msg {
			t.Errorf("password %q: RedactError changed a message without a secret:\n got %s\nwant %s", tc.password, got, msg)
		}
		quoted := "bad setting in " + tc.dsn + " at start"
		got := RedactError(quoted, tc.dsn)
		want := "bad setting in " + Describe(tc.dsn) + " at start"
		if got != want {
			t.Errorf("password %q: the quoted DSN is not replaced by its description:\n got %s\nwant %s", tc.password, got, want)
		}
		if strings.Contains(got, "password") {
			t.Errorf("password %q: %q still shows a password field", tc.password, got)
		}
	}
	if d := Describe("host=db user=app password=app dbname=app"); d != "host=db port=5432 user=app dbname=app" {
		t.Errorf("Describe = %q", d)
	}
}

// A connection string that does not parse has no reliable field
// boundaries, so it is never echoed, not even masked.
func TestUnparseableDSNIsDescribedNotEchoed(t *testing.T) {
	for _, dsn := range []string{
		"postgres://relay:s3cret@127.0.0.1:notaport/app",
		"host=db user=relay password='s3cret dbname=app",
		"host=db port=abc user=relay password=s3cret",
	} {
		err := Config{DSN: dsn, Table: "public.outbox"}.Validate()
		if err == nil {
			t.Fatalf("%q: Validate accepted it", dsn)
		}
		for _, leak := range []string{"s3cret", "relay", "127.0.0.1", "`"} {
			if strings.Contains(err.Error(), leak) {
				t.Errorf("%q: the error quotes the DSN (%q): %v", dsn, leak, err)
			}
		}
		if !strings.HasPrefix(err.Error(), "--pg-dsn does not parse: ") {
			t.Errorf("%q: %v", dsn, err)
		}
		if d := Describe(dsn); strings.Contains(d, "s3cret") || strings.Contains(d, "relay") {
			t.Errorf("Describe(%q) = %q", dsn, d)
		}
		// pgconn's own parse error, passed through RedactError by callers
		// that print it, loses its quote of the DSN too.
		if _, perr := Dial(t.Context(), Config{DSN: dsn}); perr == nil {
			t.Fatalf("%q: Dial parsed it", dsn)
		} else if got := RedactError(perr.Error(), dsn); strings.Contains(got, "s3cret") || strings.Contains(got, "relay") {
			t.Errorf("%q: RedactError(%q) = %q", dsn, perr, got)
		}
	}
}

func TestSplitTableFlagNamesTheFlag(t *testing.T) {
	if _, _, err := SplitTableFlag("--quarantine-table", "a.b.c"); err == nil || !strings.HasPrefix(err.Error(), `--quarantine-table "a.b.c"`) {
		t.Errorf("err = %v", err)
	}
	if s, tb, err := SplitTableFlag("--quarantine-table", "q"); err != nil || s != "public" || tb != "q" {
		t.Errorf("q -> %q %q %v", s, tb, err)
	}
	if _, _, err := SplitTable("a.b.c"); err == nil || !strings.HasPrefix(err.Error(), `--table "a.b.c"`) {
		t.Errorf("err = %v", err)
	}
}

// --table follows PostgreSQL's quoting: a quoted part may hold a dot or a
// doubled quote (issue 30: "S"."a.b" was refused), and an unquoted part is
// kept as written.
func TestSplitTableQuoting(t *testing.T) {
	for _, tc := range []struct{ in, schema, table string }{
		{"outbox_events", "public", "outbox_events"},
		{"app.outbox_events", "app", "outbox_events"},
		{`"S"."a.b"`, "S", "a.b"},
		{`"a""b".c`, `a"b`, "c"},
		{`s."T"`, "s", "T"},
		{`"a.b"`, "public", "a.b"},
		{`"x""".y`, `x"`, "y"},
		{"App.Outbox", "App", "Outbox"},
		{`sales.odd"name`, "sales", `odd"name`},
		{`my schema.refused "events"`, "my schema", `refused "events"`},
	} {
		s, tb, err := SplitTable(tc.in)
		if err != nil || s != tc.schema || tb != tc.table {
			t.Errorf("SplitTable(%s) = %q, %q, %v; want %q, %q", tc.in, s, tb, err, tc.schema, tc.table)
		}
	}
	for _, bad := range []string{"", ".", "a.", ".b", "a.b.c", `"a`, `"a"b.c`, `"".c`, `"S"."a.b".c`, `"a".`} {
		if s, tb, err := SplitTable(bad); err == nil {
			t.Errorf("SplitTable(%s) = %q, %q; want an error", bad, s, tb)
		}
	}
}

// Describe is what the relay prints of a DSN: never the password, in any
// of the forms a DSN can carry it, but the user and the database.
func TestDescribeShowsNoPassword(t *testing.T) {
	for in, secret := range map[string]string{
		"postgres://relay:s3cret@db:5432/app?sslmode=verify-full": "s3cret",
		"host=db user=relay password=s3cret dbname=app":           "s3cret",
		"host=db user=relay password='s3 cret' dbname=app":        "s3 cret",
	} {
		out := Describe(in)
		if strings.Contains(out, secret) {
			t.Errorf("Describe(%q) = %q still has the password", in, out)
		}
		if !strings.Contains(out, "user=relay") || !strings.Contains(out, "dbname=app") {
			t.Errorf("Describe(%q) = %q lost the user or the database", in, out)
		}
	}
}
