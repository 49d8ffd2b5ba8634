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

	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/store"
)

//go:embed *.sql
var files embed.FS

// Names are the database objects the SQL creates.
type Names struct {
	Schema      string
	Table       string
	Publication string
	// Quarantine is the schema-qualified quarantine table; empty means
	// the default (see store.QuarantineTable).
	Quarantine string
	// ExternalTable says the outbox table is another tool's (a Debezium
	// outbox table): the migrations check it exists and never create or
	// change it; the publication and the quarantine table are made as
	// usual.
	ExternalTable bool
}

// ownTable are the migrations that create or change the relay's own outbox
// table; they are left out for an external table. A new migration that
// touches the outbox table belongs here.
var ownTable = map[string]bool{"001_outbox.sql": true}

// QuarantineTable returns the quarantine table.
func (n Names) QuarantineTable() (store.Table, error) {
	return store.QuarantineTable(store.Table{Schema: n.Schema, Name: n.Table}.String(), n.Quarantine)
}

// dollarTag quotes the migrations' DO blocks.
const dollarTag = "$migrate$"

// validate refuses a name no PostgreSQL identifier can be, before it goes
// near SQL; quoting then makes any other name safe.
func (n Names) validate() error {
	for _, name := range []struct{ flag, value string }{
		{"--table (schema)", n.Schema}, {"--table", n.Table}, {"--publication", n.Publication},
	} {
		if err := replication.ValidateIdentifier(name.flag, name.value); err != nil {
			return err
		}
		if strings.Contains(name.value, dollarTag) {
			// The names go into a block quoted with this tag.
			return fmt.Errorf("%s %q: must not contain %s", name.flag, name.value, dollarTag)
		}
	}
	return nil
}

// SQL returns the migrations for these names, in order, as one script.
// Every name is validated and quoted, so no name can change the script.
func SQL(n Names) (string, error) {
	if err := n.validate(); err != nil {
		return "", err
	}
	quarantine, err := n.QuarantineTable()
	if err != nil {
		return "", err
	}
	entries, err := fs.Glob(files, "*.sql")
	if err != nil {
		return "", fmt.Errorf("list migrations: %w", err)
	}
	sort.Strings(entries)
	table := store.Table{Schema: n.Schema, Name: n.Table}
	r := strings.NewReplacer(
		"{{quarantine}}", quarantine.Quoted(),
		"{{table}}", table.Quoted(),
		// Named after the table, and quoted whole: a name with a space or
		// a quote must not break the DDL.
		"{{headers_check}}", pgx.Identifier{n.Table + "_headers_shape"}.Sanitize(),
		"{{created_at_index}}", pgx.Identifier{n.Table + "_created_at_idx"}.Sanitize(),
		"{{publication}}", pgx.Identifier{n.Publication}.Sanitize(),
		"{{publication_literal}}", "'"+strings.ReplaceAll(n.Publication, "'", "''")+"'",
	)
	var b strings.Builder
	for _, name := range entries {
		if n.ExternalTable && ownTable[name] {
			continue
		}
		body, err := files.ReadFile(name)
		if err != nil {
			return "", fmt.Errorf("read migration %s: %w", name, err)
		}
		fmt.Fprintf(&b, "-- %s\n%s\n", name, r.Replace(string(body)))
	}
	return b.String(), nil
}

// SlotSQL returns the statement that creates the replication slot, for
// scripts run by hand; the slot name is validated first.
func SlotSQL(slot string) (string, error) {
	if err := replication.ValidateSlotName(slot); err != nil {
		return "", err
	}
	return fmt.Sprintf("-- the replication slot, created by the relay's role (REPLICATION):\nSELECT pg_create_logical_replication_slot('%s', 'pgoutput');\n", slot), nil
}

// Apply runs the migrations in one transaction and returns the objects it
// created, none when the schema was already in place. A transaction-scoped
// advisory lock keeps two instances that migrate at once from racing.
func Apply(ctx context.Context, conn *pgx.Conn, n Names) (created []string, err error) {
	script, err := SQL(n)
	if err != nil {
		return nil, err
	}
	quarantine, err := n.QuarantineTable()
	if err != nil {
		return nil, err
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("begin migration: %w", err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtext('outbox-relay migrate'))"); err != nil {
		return nil, fmt.Errorf("lock for migration: %w", err)
	}
	outbox := store.Table{Schema: n.Schema, Name: n.Table}
	const tableExists = "SELECT to_regclass($1) IS NOT NULL"
	if n.ExternalTable {
		var exists bool
		if err := tx.QueryRow(ctx, tableExists, outbox.Quoted()).Scan(&exists); err != nil {
			return nil, fmt.Errorf("look up outbox table %s: %w", outbox, err)
		}
		if !exists {
			return nil, fmt.Errorf("%w: outbox table %s does not exist, and migrate does not create a Debezium outbox table: fix --table, or create the table your services write (Debezium's outbox columns: id uuid, aggregatetype, aggregateid, type varchar, payload jsonb) and run migrate again",
				replication.ErrPrecondition, outbox)
		}
	}
	objects := []struct{ what, exists, arg string }{
		{"outbox table " + outbox.String(), tableExists, outbox.Quoted()},
		{"publication " + n.Publication, "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", n.Publication},
		{"quarantine table " + quarantine.String(), tableExists, quarantine.Quoted()},
		// A quarantine table from before replay kept its events gets these.
		{"columns replayed_at, replayed_topic of " + quarantine.String(),
			"SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'replayed_at' AND NOT attisdropped)",
			quarantine.Quoted()},
	}
	const quarantineTable, replayColumns = 2, 3 // in objects
	existed := make([]bool, len(objects))
	for i, o := range objects {
		if i == 0 && n.ExternalTable {
			existed[i] = true // checked above; never created here
			continue
		}
		if err := tx.QueryRow(ctx, o.exists, o.arg).Scan(&existed[i]); err != nil {
			return nil, fmt.Errorf("look up %s: %w", o.what, err)
		}
	}
	if !existed[quarantineTable] {
		existed[replayColumns] = true // a new table comes with them: not worth a line of their own
	}
	if _, err := tx.Exec(ctx, script); err != nil {
		return nil, fmt.Errorf("apply migrations: %w (migrate must run as the owner of the schema; see the README's SQL for running it with your own tool)", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("commit migration: %w", err)
	}
	for i, o := range objects {
		if !existed[i] {
			created = append(created, o.what)
		}
	}
	return created, nil
}
