// Package migrations holds the SQL that prepares a database for the relay:
// the outbox table, its publication and the quarantine table. The SQL is embedded in the binary and
// safe to apply any number of times. Creating the replication slot belongs to
// the same step (see the migrate command); a slot records only what is
// committed after it exists.
package migrations

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"
)

//go:embed *.sql
var files embed.FS

// Names are the database objects the SQL creates.
type Names struct {
	Schema      string
	Table       string
	Publication string
	// Quarantine is the schema-qualified quarantine table; empty means
	// outbox_quarantine in the outbox table's schema.
	Quarantine string
}

// QuarantineTable returns the quarantine table's schema and name.
func (n Names) QuarantineTable() (schema, table string) {
	if n.Quarantine == "" {
		return n.Schema, "outbox_quarantine"
	}
	if i := strings.IndexByte(n.Quarantine, '.'); i >= 0 {
		return n.Quarantine[:i], n.Quarantine[i+1:]
	}
	return n.Schema, n.Quarantine
}

// SQL returns the migrations for these names, in order, as one script.
func SQL(n Names) (string, error) {
	entries, err := fs.Glob(files, "*.sql")
	if err != nil {
		return "", fmt.Errorf("list migrations: %w", err)
	}
	sort.Strings(entries)
	qSchema, qTable := n.QuarantineTable()
	r := strings.NewReplacer(
		"{{quarantine}}", ident(qSchema)+"."+ident(qTable),
		"{{table}}", ident(n.Schema)+"."+ident(n.Table),
		"{{table_name}}", strings.Trim(ident(n.Table), `"`),
		"{{publication}}", ident(n.Publication),
		"{{publication_literal}}", "'"+strings.ReplaceAll(n.Publication, "'", "''")+"'",
	)
	var b strings.Builder
	for _, name := range entries {
		body, err := files.ReadFile(name)
		if err != nil {
			return "", fmt.Errorf("read migration %s: %w", name, err)
		}
		fmt.Fprintf(&b, "-- %s\n%s\n", name, r.Replace(string(body)))
	}
	return b.String(), nil
}

// Apply runs the migrations in one transaction. A transaction-scoped advisory
// lock keeps two instances that migrate at once from racing.
func Apply(ctx context.Context, conn *pgx.Conn, n Names) error {
	script, err := SQL(n)
	if err != nil {
		return err
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin migration: %w", err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtext('outbox-relay migrate'))"); err != nil {
		return fmt.Errorf("lock for migration: %w", err)
	}
	if _, err := tx.Exec(ctx, script); err != nil {
		return fmt.Errorf("apply migrations: %w (migrate must run as the owner of the schema; see the README's SQL for running it with your own tool)", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit migration: %w", err)
	}
	return nil
}

func ident(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
