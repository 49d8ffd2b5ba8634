package migrations

import (
	"strings"
	"testing"
)

func TestSQLQuotesNames(t *testing.T) {
	sql, err := SQL(Names{Schema: "sales", Table: `odd"name`, Publication: "pub'x"})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`CREATE TABLE IF NOT EXISTS "sales"."odd""name"`,
		`pubname = 'pub''x'`,
		`CREATE PUBLICATION "pub'x" FOR TABLE "sales"."odd""name" WITH (publish = 'insert')`,
		`CREATE TABLE IF NOT EXISTS "sales"."outbox_quarantine"`,
	} {
		if !strings.Contains(sql, want) {
			t.Errorf("SQL lacks %s", want)
		}
	}
	if strings.Contains(sql, "{{") {
		t.Errorf("unreplaced placeholder in:\n%s", sql)
	}
}

func TestQuarantineTableName(t *testing.T) {
	for _, c := range []struct {
		names         Names
		schema, table string
	}{
		{Names{Schema: "app"}, "app", "outbox_quarantine"},
		{Names{Schema: "app", Quarantine: "ops.refused"}, "ops", "refused"},
		{Names{Schema: "app", Quarantine: "refused"}, "app", "refused"},
	} {
		s, tb := c.names.QuarantineTable()
		if s != c.schema || tb != c.table {
			t.Errorf("%+v: %s.%s, want %s.%s", c.names, s, tb, c.schema, c.table)
		}
	}
}
