package replication

import (
	"context"
	"fmt"
	"slices"
	"strings"
)

// columnRule is what the relay accepts for one outbox column. The relay
// reads every value in PostgreSQL's text form, so a type is acceptable when
// that text is what the Kafka record must carry: uuid or text for ids, JSON
// (or text holding it) for the payload, an integer for schema_version, a
// timestamp for the times.
type columnRule struct {
	name     string
	required bool
	types    []string // format_type() names of the base type
}

// outboxColumns lists the outbox table's columns the relay reads, and the
// types it accepts for each; docs/operations.md documents the same table.
var outboxColumns = []columnRule{
	{"event_id", true, []string{"uuid", "text", "character varying"}},
	{"aggregate_type", true, []string{"text", "character varying"}},
	{"aggregate_id", true, []string{"text", "character varying"}},
	{"event_type", true, []string{"text", "character varying"}},
	{"schema_version", false, []string{"integer", "smallint", "bigint"}},
	{"payload", true, []string{"jsonb", "json", "text"}},
	{"headers", false, []string{"jsonb", "json"}},
	{"occurred_at", false, []string{"timestamp with time zone", "timestamp without time zone"}},
	{"created_at", false, []string{"timestamp with time zone", "timestamp without time zone"}},
}

// CheckColumns verifies the outbox table's columns have types whose text
// form the relay can publish, and names every column at fault with the type
// found and the types accepted. A bytea payload, for one, would otherwise
// be published as the text \x00ff...
func (a *Admin) CheckColumns(ctx context.Context) error {
	schema, table, err := SplitTable(a.cfg.Table)
	if err != nil {
		return err
	}
	// A domain is judged by its base type.
	rows, err := a.conn.Query(ctx, `
		SELECT a.attname, format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END, NULL)
		FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
		WHERE a.attrelid = to_regclass(format('%I.%I', $1::text, $2::text)) AND a.attnum > 0 AND NOT a.attisdropped`,
		schema, table)
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", a.cfg.Table, err)
	}
	found := map[string]string{}
	for rows.Next() {
		var name, typ string
		if err := rows.Scan(&name, &typ); err != nil {
			rows.Close()
			return fmt.Errorf("read columns of %s: %w", a.cfg.Table, err)
		}
		found[name] = typ
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read columns of %s: %w", a.cfg.Table, err)
	}
	if problems := columnProblems(found); len(problems) > 0 {
		return precondition("outbox table %s.%s: %s. Fix the table (ALTER TABLE ... ALTER COLUMN ... TYPE ...) or point --table at the right one; `outbox-relay migrate --print-sql` shows the expected definition",
			schema, table, strings.Join(problems, "; "))
	}
	return nil
}

// columnProblems compares a table's columns (name to type) with the rules.
func columnProblems(found map[string]string) []string {
	var problems []string
	for _, rule := range outboxColumns {
		typ, ok := found[rule.name]
		switch {
		case !ok && rule.required:
			problems = append(problems, fmt.Sprintf("column %s is missing (want %s)", rule.name, strings.Join(rule.types, " or ")))
		case ok && !slices.Contains(rule.types, typ):
			problems = append(problems, fmt.Sprintf("column %s is %s, want %s", rule.name, typ, strings.Join(rule.types, " or ")))
		}
	}
	return problems
}
