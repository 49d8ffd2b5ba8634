package outbox

import "testing"

// The writer reads a table name as the relay's --table does: a quoted part
// may hold a dot, so a service can write to the table the relay reads.
func TestNewReadsQuotedTableNames(t *testing.T) {
	for in, want := range map[string]string{
		"":               `"public"."outbox_events"`,
		"outbox":         `"public"."outbox"`,
		`"S"."a.b"`:      `"S"."a.b"`,
		`"a""b".c`:       `"a""b"."c"`,
		"App.Outbox":     `"App"."Outbox"`,
		`sales.odd"name`: `"sales"."odd""name"`,
	} {
		w, err := New(in)
		if err != nil {
			t.Errorf("New(%s): %v; want table %s", in, err, want)
		} else if w.table != want {
			t.Errorf("New(%s): table %s; want %s", in, w.table, want)
		}
	}
	for _, bad := range []string{"a.b.c", `"a`, "a.", `"S"."a.b".c`} {
		if _, err := New(bad); err == nil {
			t.Errorf("New(%s) accepted it", bad)
		}
	}
}
