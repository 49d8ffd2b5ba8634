package pg

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
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
