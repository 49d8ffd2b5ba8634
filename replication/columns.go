package replication

import (
	"context"
	"fmt"
	"strings"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
)

// CheckColumns verifies the outbox table's columns, named by the layout,
// have types whose text form the relay can publish (docs/reference/tables.md
// documents the rules; package layout holds them), and names every column at fault with the type
// found and the types accepted. An integer payload, for one, would
// otherwise be published as its digits.
func (a *Admin) CheckColumns(ctx context.Context) error {
	schema, table, err := pg.SplitTable(a.cfg.Table)
	if err != nil {
		return err
	}
	// A domain is judged by its base type, but for a bytea payload: the
	// stream names a domain's own type, so the decoder could not tell its
	// rows carry bytes.
	rows, err := a.conn.Query(ctx, `
		SELECT a.attname, CASE WHEN t.typtype = 'd' AND t.typbasetype = 'bytea'::regtype THEN 'a domain over bytea'
			ELSE format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END, NULL) END
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
	l := a.cfg.OutboxLayout()
	if len(found) == 0 && !l.CreatesTable() {
		return pg.Preconditionf("outbox table %s.%s does not exist. With --outbox-layout %s the relay reads the table your services already write and never creates it: fix --table, or create the table as Debezium's outbox documentation describes (id, aggregatetype, aggregateid, type, payload)",
			schema, table, l.Name())
	}
	if problems := l.ColumnProblems(found); len(problems) > 0 {
		flagged := len(l.MissingNamedColumns(func(c string) bool { _, ok := found[c]; return ok })) > 0
		if !l.CreatesTable() || flagged {
			return fmt.Errorf("%w: %w: outbox table %s.%s: %s. Map the columns with the --column-* flags and --header-columns, point --table at the right table, or fix its column types (ALTER TABLE ... ALTER COLUMN ... TYPE ...)",
				pg.ErrPrecondition, layout.ErrColumnMapping, schema, table, strings.Join(problems, "; "))
		}
		return pg.Preconditionf("outbox table %s.%s: %s. Fix the table (ALTER TABLE ... ALTER COLUMN ... TYPE ...) or point --table at the right one; `outbox-relay migrate --print-sql` shows the expected definition",
			schema, table, strings.Join(problems, "; "))
	}
	return nil
}
