package pg

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/layout"
)

// Querier is what the privilege checks need of a connection; *pgx.Conn has
// it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// RequireSchemaUsage checks the role may look into each schema. Without
// USAGE every lookup of a table in it fails with "permission denied for
// schema", which is no failure a retry can fix: it is a precondition, with
// the GRANT to run. A schema that does not exist passes: the table lookup
// that follows says the table is missing.
func RequireSchemaUsage(ctx context.Context, conn Querier, schemas ...string) error {
	seen := map[string]bool{}
	for _, schema := range schemas {
		if seen[schema] {
			continue
		}
		seen[schema] = true
		var role string
		var usage *bool
		err := conn.QueryRow(ctx, `SELECT current_user, (SELECT has_schema_privilege(oid, 'USAGE') FROM pg_namespace WHERE nspname = $1)`,
			schema).Scan(&role, &usage)
		if err != nil {
			return fmt.Errorf("check usage of schema %s: %w", schema, err)
		}
		if usage != nil && !*usage {
			return Preconditionf("role %q lacks USAGE on schema %s, so it cannot see the tables in it: run GRANT USAGE ON SCHEMA %s TO %s; as the schema's owner",
				role, schema, QuoteIdent(schema), QuoteIdent(role))
		}
	}
	return nil
}

// RequireTablePrivileges checks the role holds privs on the table
// (schema-qualified, quoted) and names the GRANT to run when it does not;
// why says what needs them.
func RequireTablePrivileges(ctx context.Context, conn Querier, quotedTable string, privs []string, why string) error {
	var role string
	var missing []string
	for _, priv := range privs {
		var ok bool
		if err := conn.QueryRow(ctx, "SELECT current_user, has_table_privilege($1, $2)", quotedTable, priv).Scan(&role, &ok); err != nil {
			return fmt.Errorf("check %s on %s: %w", priv, quotedTable, err)
		}
		if !ok {
			missing = append(missing, priv)
		}
	}
	if len(missing) > 0 {
		return Preconditionf("role %q lacks %s on %s, which %s needs: run GRANT %s ON %s TO %s; as the table's owner",
			role, strings.Join(missing, ", "), quotedTable, why, strings.Join(privs, ", "), quotedTable, QuoteIdent(role))
	}
	return nil
}

// CheckRetention verifies what deleting published rows needs, before a
// source starts (every table source deletes by one rule: published, and
// inserted longer ago than --retention): the column that dates a row (a Debezium table has no
// "timestamp" column unless one was added, and --column-created-at names
// another) with a time type, and SELECT and DELETE on the table. Without
// the column the cleanup would fail at every interval behind a ready
// relay.
func CheckRetention(ctx context.Context, conn Querier, cfg Config) error {
	if err := CheckCreatedAt(ctx, conn, cfg, "--retention deletes rows by the time they were inserted", "or leave --retention unset"); err != nil {
		return err
	}
	return RequireTablePrivileges(ctx, conn, QuotedTable(cfg.Table), []string{"SELECT", "DELETE"}, "--retention")
}

// QuotedTable quotes schema.table for SQL and messages; a name that does
// not split is returned as it is, for the query that fails on it to say so.
func QuotedTable(name string) string {
	schema, table, err := SplitTable(name)
	if err != nil {
		return name
	}
	return QuoteIdent(schema) + "." + QuoteIdent(table)
}

// CheckCreatedAt verifies that the outbox table has the column that dates
// a row (--column-created-at) with a time type: what needs it says why,
// and instead what else the operator can do. A missing or mistyped column
// is a flag problem (layout.ErrColumnMapping), found at start.
func CheckCreatedAt(ctx context.Context, conn Querier, cfg Config, what, instead string) error {
	quoted := QuotedTable(cfg.Table)
	col := cfg.OutboxLayout().Column(layout.CreatedAt)
	var typ string
	err := conn.QueryRow(ctx, `
		SELECT format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END, NULL)
		FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
		WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped`, quoted, col).Scan(&typ)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: %w: %s, but the outbox table %s has no column %s: name the table's insert-time column with --column-created-at, add one (ALTER TABLE %s ADD COLUMN %s timestamptz NOT NULL DEFAULT now()), %s",
			ErrPrecondition, layout.ErrColumnMapping, what, quoted, QuoteIdent(col), quoted, QuoteIdent(col), instead)
	}
	if err != nil {
		return fmt.Errorf("read column %s of %s: %w", col, quoted, err)
	}
	if typ != "timestamp with time zone" && typ != "timestamp without time zone" {
		return fmt.Errorf("%w: %w: %s, and column %s of %s is %s, not a timestamp: name the insert-time column with --column-created-at, %s",
			ErrPrecondition, layout.ErrColumnMapping, what, QuoteIdent(col), quoted, typ, instead)
	}
	return nil
}
