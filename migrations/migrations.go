// Package migrations holds the SQL that prepares a database for the relay:
// the outbox table, its publication and the quarantine table; poll mode's
// state table; or, for the messages source, a publication of no table and
// the quarantine table. The SQL is embedded in the binary and
// safe to apply any number of times. Creating the replication slot belongs to
// the same step (see the migrate command); a slot records only what is
// committed after it exists.
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/store"
)

//go:embed *.sql poll/*.sql poll_snapshot/*.sql messages/*.sql
var files embed.FS

// Names are the database objects the SQL creates.
type Names struct {
	Schema      string
	Table       string
	Publication string
	// Quarantine is the schema-qualified quarantine table; empty means
	// the default (see store.QuarantineTable).
	Quarantine string
	// Poll adds what poll mode needs (migrations/poll): its state table, the
	// trigger that fills it, and its indexes.
	Poll bool
	// PollSnapshot adds what poll mode's snapshot strategy needs instead
	// (migrations/poll_snapshot): two columns of the outbox table with
	// their defaults, an index, the progress table and a notifying
	// trigger. No state row per event.
	PollSnapshot bool
	// PollQuiet leaves out poll mode's NOTIFY: the snapshot strategy's
	// trigger that only notifies is dropped, and the lease strategy's
	// tracking trigger records rows without notifying. PostgreSQL refuses
	// PREPARE TRANSACTION in a transaction that notified.
	PollQuiet bool
	// ExistingPublished marks the rows already in the outbox as published
	// when poll mode starts tracking them, instead of pending.
	ExistingPublished bool
	// Layout names the outbox table's columns poll mode's trigger reads;
	// nil is the relay's own.
	Layout *layout.Layout
	// ExternalTable says the outbox table is another tool's (a Debezium
	// outbox table): the migrations check it exists and never create or
	// change it; the publication and the quarantine table are made as
	// usual.
	ExternalTable bool
	// Messages is the messages source's schema (migrations/messages): a
	// publication of no table and the quarantine table; no outbox table.
	Messages bool
}

// ownTable are the migrations that create or change the relay's own outbox
// table; they are left out for an external table. A new migration that
// touches the outbox table belongs here.
var ownTable = map[string]bool{"001_outbox.sql": true, "007_outbox_order.sql": true, "008_outbox_stamp.sql": true}

// tableSource are the migrations that only a source reading an outbox
// table needs; the messages source has its own publication instead.
var tableSource = map[string]bool{"001_outbox.sql": true, "001_outbox_publication.sql": true, "007_outbox_order.sql": true,
	"008_outbox_stamp.sql": true, "009_slots.sql": true}

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
		if err := pg.ValidateIdentifier(name.flag, name.value); err != nil {
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
	poll, err := store.PollStateTable(table)
	if err != nil {
		return "", err
	}
	snap, err := store.PollSnapshotTable(table)
	if err != nil {
		return "", err
	}
	for _, extra := range []struct {
		dir  string
		used bool
	}{{"poll", n.Poll}, {"poll_snapshot", n.PollSnapshot}, {"messages", n.Messages}} {
		if !extra.used {
			continue
		}
		more, err := fs.Glob(files, extra.dir+"/*.sql")
		if err != nil {
			return "", fmt.Errorf("list migrations: %w", err)
		}
		sort.Strings(more)
		entries = append(entries, more...)
	}
	l := n.Layout
	if l == nil {
		l = layout.Relay
	}
	column := func(f layout.Field) string { return pgx.Identifier{l.Column(f)}.Sanitize() }
	existingPublishedAt, existingPublished := "NULL::timestamptz", "false"
	if n.ExistingPublished {
		existingPublishedAt, existingPublished = "now()", "true"
	}
	r := strings.NewReplacer(
		"{{poll}}", poll.Quoted(),
		"{{poll_literal}}", literal(poll.Quoted()),
		"{{poll_seq}}", pgx.Identifier{poll.Schema, poll.Name + "_seq"}.Sanitize(),
		"{{poll_seq_literal}}", literal(pgx.Identifier{poll.Schema, poll.Name + "_seq"}.Sanitize()),
		"{{poll_pending_index}}", pgx.Identifier{poll.Name + "_pending_idx"}.Sanitize(),
		"{{poll_aggregate_index}}", pgx.Identifier{poll.Name + "_aggregate_idx"}.Sanitize(),
		"{{poll_quarantined_index}}", pgx.Identifier{poll.Name + "_quarantined_idx"}.Sanitize(),
		"{{poll_track}}", pgx.Identifier{poll.Schema, poll.Name + "_track"}.Sanitize(),
		"{{poll_trigger}}", pgx.Identifier{poll.Name + "_track"}.Sanitize(),
		"{{order_seq}}", store.OrderSequence(table).Quoted(),
		"{{order_seq_literal}}", literal(store.OrderSequence(table).Quoted()),
		"{{snap}}", snap.Quoted(),
		"{{snap_seq}}", pgx.Identifier{snap.Schema, snap.Name + "_seq"}.Sanitize(),
		"{{snap_seq_literal}}", literal(pgx.Identifier{snap.Schema, snap.Name + "_seq"}.Sanitize()),
		"{{snap_xid_index}}", pgx.Identifier{snap.Name + "_xid_idx"}.Sanitize(),
		"{{snap_notify}}", pgx.Identifier{snap.Schema, snap.Name + "_notify"}.Sanitize(),
		"{{existing_published}}", existingPublished,
		"{{snap_notify_trigger}}", snapNotifyTrigger(n, table, snap),
		"{{poll_notify}}", pollNotify(n, table),
		"{{stamp}}", stampSQL(table),
		"{{table_literal}}", literal(table.Quoted()),
		"{{existing_published_at_literal}}", literal(existingPublishedAt),
		"{{snap_literal}}", literal(snap.Quoted()),
		"{{event_id}}", column(layout.EventID),
		"{{aggregate_type}}", column(layout.AggregateType),
		"{{aggregate_id}}", column(layout.AggregateID),
		"{{event_id_literal}}", literal(l.Column(layout.EventID)),
		"{{aggregate_type_literal}}", literal(l.Column(layout.AggregateType)),
		"{{aggregate_id_literal}}", literal(l.Column(layout.AggregateID)),
		"{{created_at_literal}}", literal(l.Column(layout.CreatedAt)),
		"{{quarantine}}", quarantine.Quoted(),
		"{{slots}}", store.SlotRegistry(table).Quoted(),
		"{{partitions}}", store.PartitionRegistry(table).Quoted(),
		"{{table}}", table.Quoted(),
		// Named after the table, and quoted whole: a name with a space or
		// a quote must not break the DDL.
		"{{headers_check}}", pgx.Identifier{n.Table + "_headers_shape"}.Sanitize(),
		"{{created_at_index}}", pgx.Identifier{n.Table + "_created_at_idx"}.Sanitize(),
		"{{publication}}", pgx.Identifier{n.Publication}.Sanitize(),
		"{{publication_literal}}", literal(n.Publication),
	)
	var b strings.Builder
	for _, name := range entries {
		if n.ExternalTable && ownTable[name] || n.Messages && tableSource[name] {
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

// untrackedBySnapshot counts the outbox rows with no transaction id, which
// the snapshot strategy's progress row does not cover yet: all of them
// before its columns exist.
func untrackedBySnapshot(ctx context.Context, tx pgx.Tx, outbox store.Table) (int64, error) {
	snap, err := store.PollSnapshotTable(outbox)
	if err != nil {
		return 0, err
	}
	var progressExists, columnExists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL,
		EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($2) AND attname = $3 AND NOT attisdropped)`,
		snap.Quoted(), outbox.Quoted(), store.SnapshotXidColumn).Scan(&progressExists, &columnExists); err != nil {
		return 0, fmt.Errorf("look up poll snapshot progress table %s: %w", snap, err)
	}
	if progressExists {
		return 0, nil // counted when it was made
	}
	query := "SELECT count(*) FROM " + outbox.Quoted()
	if columnExists {
		query += " WHERE " + store.SnapshotXidColumn + " IS NULL"
	}
	var count int64
	if err := tx.QueryRow(ctx, query).Scan(&count); err != nil {
		return 0, fmt.Errorf("count outbox rows from before the snapshot strategy: %w", err)
	}
	return count, nil
}

// pollNotify is the lease strategy's trigger's wake-up for the pollers,
// or with PollQuiet a line that says why there is none.
func pollNotify(n Names, table store.Table) string {
	if n.PollQuiet {
		return "-- No NOTIFY (migrate --poll-notify=false): writers PREPARE TRANSACTION."
	}
	return "PERFORM pg_notify('outbox_relay_poll', " + literal(table.Quoted()) + ");"
}

// snapNotifyTrigger is the statement that puts the snapshot strategy's
// NOTIFY trigger on the outbox, or with PollQuiet takes it off.
func snapNotifyTrigger(n Names, table, snap store.Table) string {
	trigger := pgx.Identifier{snap.Name + "_notify"}.Sanitize()
	if n.PollQuiet {
		return "DROP TRIGGER IF EXISTS " + trigger + " ON " + table.Quoted() + ";"
	}
	return "CREATE OR REPLACE TRIGGER " + trigger + " AFTER INSERT ON " + table.Quoted() + "\n    FOR EACH STATEMENT EXECUTE FUNCTION " +
		pgx.Identifier{snap.Schema, snap.Name + "_notify"}.Sanitize() + "();"
}

// stampSQL (re)makes the trigger that overwrites, on every inserted row,
// the columns the relay owns that the table has: outbox_relay_seq from its
// default's sequence (insertion order, which republishing and the
// snapshot strategy read), and outbox_relay_xid with the inserting
// transaction's id (which the snapshot strategy reads). A default alone
// is what the writer leaves out; an ORM that inserts every mapped column,
// an INSERT ... SELECT * copy or a copy tool fills it with NULL or a stale
// value instead. The function is built from the columns present, so one
// trigger serves the WAL path's table and the snapshot strategy's, and
// running either migration again keeps what the other added. Not SECURITY
// DEFINER and no pinned search path: it names every object by OID or with
// pg_catalog, and the writer's role may use the sequence (granted to
// PUBLIC where migrate made it). ENABLE ALWAYS: it fires under
// session_replication_role = replica too, as a copy by logical
// replication runs, whose rows carry another server's transaction ids.
func stampSQL(table store.Table) string {
	trigger := store.StampTrigger(table)
	function := pgx.Identifier{table.Schema, trigger}.Sanitize()
	r := strings.NewReplacer("{{table_literal}}", literal(table.Quoted()),
		"{{function_literal}}", literal(function), "{{trigger_literal}}", literal(pgx.Identifier{trigger}.Sanitize()),
		"{{xid_literal}}", literal(store.SnapshotXidColumn), "{{seq_literal}}", literal(store.OrderColumn))
	return r.Replace(`DO $migrate$
DECLARE
    body text := '';
    keep text := '';
    seq oid;
BEGIN
    IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = {{table_literal}}::regclass AND attname = {{xid_literal}} AND NOT attisdropped) THEN
        body := body || format('NEW.%I := pg_catalog.pg_current_xact_id(); ', {{xid_literal}});
        keep := keep || format('NEW.%I := OLD.%I; ', {{xid_literal}}, {{xid_literal}});
    END IF;
    SELECT dep.refobjid INTO seq FROM pg_attrdef d
        JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
        JOIN pg_depend dep ON dep.classid = 'pg_attrdef'::regclass AND dep.objid = d.oid AND dep.refclassid = 'pg_class'::regclass
        JOIN pg_class c ON c.oid = dep.refobjid AND c.relkind = 'S'
        WHERE d.adrelid = {{table_literal}}::regclass AND a.attname = {{seq_literal}} AND NOT a.attisdropped;
    IF seq IS NOT NULL THEN
        body := body || format('NEW.%I := pg_catalog.nextval(%s::pg_catalog.oid::pg_catalog.regclass); ', {{seq_literal}}, seq);
        keep := keep || format('NEW.%I := OLD.%I; ', {{seq_literal}}, {{seq_literal}});
    END IF;
    IF body = '' THEN
        RETURN;
    END IF;
    -- An UPDATE keeps what the INSERT stamped: an ORM that writes every
    -- column back would otherwise hide the row again, or move it.
    EXECUTE format('CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', {{function_literal}},
        'BEGIN IF TG_OP = ''INSERT'' THEN ' || body || 'ELSE ' || keep || 'END IF; RETURN NEW; END');
    EXECUTE format('CREATE OR REPLACE TRIGGER %s BEFORE INSERT OR UPDATE ON %s FOR EACH ROW EXECUTE FUNCTION %s()', {{trigger_literal}}, {{table_literal}}, {{function_literal}});
    EXECUTE format('ALTER TABLE %s ENABLE ALWAYS TRIGGER %s', {{table_literal}}, {{trigger_literal}});
END
$migrate$;`)
}

// literal quotes s as an SQL string literal.
func literal(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// SlotSQL returns the statement that creates the replication slot, for
// scripts run by hand; the slot name is validated first.
func SlotSQL(slot string) (string, error) {
	if err := pg.ValidateSlotName(slot); err != nil {
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
				pg.ErrPrecondition, outbox)
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
		// And one from before binary payloads gets this.
		{"column payload_bytes of " + quarantine.String(),
			"SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'payload_bytes' AND NOT attisdropped)",
			quarantine.Quoted()},
		// And one from before contents it cannot type gets these.
		{"columns raw, raw_size, raw_sha256, raw_lsn, content_problem of " + quarantine.String(),
			"SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'content_problem' AND NOT attisdropped)",
			quarantine.Quoted()},
		// And an outbox table from before rows were numbered gets this.
		{"column " + store.OrderColumn + " of " + outbox.String(),
			"SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = '" + store.OrderColumn + "' AND NOT attisdropped)",
			outbox.Quoted()},
	}
	const quarantineTable, replayColumns, payloadBytesColumn, rawColumns, orderColumn, pollStateTable = 2, 3, 4, 5, 6, 7 // in objects
	if n.Poll {
		poll, err := store.PollStateTable(outbox)
		if err != nil {
			return nil, err
		}
		objects = append(objects,
			struct{ what, exists, arg string }{"poll state table " + poll.String(), tableExists, poll.Quoted()},
			struct{ what, exists, arg string }{"poll trigger on " + outbox.String(),
				// Named after the state table, so a name found elsewhere is still this one's.
				"SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = $1 AND NOT tgisinternal)", poll.Name + "_track"},
			// A state table from before leases named their session gets these.
			struct{ what, exists, arg string }{"columns lease_pid, lease_backend_start of " + poll.String(),
				"SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'lease_pid' AND NOT attisdropped)",
				poll.Quoted()})
	}
	if n.PollSnapshot {
		snap, err := store.PollSnapshotTable(outbox)
		if err != nil {
			return nil, err
		}
		// The relay's own table has its order column from 007_outbox_order.
		snapColumns := "column " + store.SnapshotXidColumn
		if n.ExternalTable {
			snapColumns = "columns " + store.SnapshotXidColumn + ", " + store.OrderColumn
		}
		objects = append(objects,
			struct{ what, exists, arg string }{snapColumns + " of " + outbox.String(),
				"SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = '" + store.SnapshotXidColumn + "' AND NOT attisdropped)",
				outbox.Quoted()},
			struct{ what, exists, arg string }{"poll snapshot progress table " + snap.String(), tableExists, snap.Quoted()})
		if !n.PollQuiet {
			objects = append(objects, struct{ what, exists, arg string }{"poll snapshot trigger on " + outbox.String(),
				"SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = $1 AND NOT tgisinternal)", snap.Name + "_notify"})
		}
	}
	partitions := store.PartitionRegistry(outbox)
	objects = append(objects, struct{ what, exists, arg string }{"partition count registry " + partitions.String(), tableExists, partitions.Quoted()})
	existed := make([]bool, len(objects))
	for i, o := range objects {
		if (i == 0 || i == orderColumn) && (n.ExternalTable || n.Messages) {
			existed[i] = true // checked above, or not needed; never created here
			continue
		}
		if err := tx.QueryRow(ctx, o.exists, o.arg).Scan(&existed[i]); err != nil {
			return nil, fmt.Errorf("look up %s: %w", o.what, err)
		}
	}
	if !existed[0] {
		existed[orderColumn] = true // a new outbox table comes with it
	}
	if !existed[quarantineTable] {
		// A new table comes with them: not worth a line of their own.
		existed[replayColumns], existed[payloadBytesColumn], existed[rawColumns] = true, true, true
	}
	if n.Poll && !existed[pollStateTable] {
		existed[pollStateTable+2] = true // the lease columns come with a new state table too
	}
	untracked, err := untrackedRows(ctx, tx, n, existed[0])
	if err != nil {
		return nil, err
	}
	if _, err := tx.Exec(ctx, script); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
			return nil, fmt.Errorf("apply migrations: %w (lock_timeout ran out: changing a table waits for the transactions using it to end, and they did not in time; nothing was changed: run migrate again, at a quieter time or with a longer lock_timeout)", err)
		}
		return nil, fmt.Errorf("apply migrations: %w (migrate must run as the owner of the schema; migrate --print-sql prints the SQL for running it with your own tool)", err)
	}
	if untracked > 0 {
		state := "pending: poll mode publishes them"
		if n.ExistingPublished {
			state = "published, as --poll-existing published says"
		}
		what := fmt.Sprintf("poll state of %d rows already in the outbox, marked %s", untracked, state)
		if n.Poll && n.ExistingPublished {
			bySnapshot, err := snapshotPending(ctx, tx, outbox)
			if err != nil {
				return nil, err
			}
			if bySnapshot >= 0 {
				what += fmt.Sprintf(", except the %d the snapshot strategy's progress does not cover: pending, published first", bySnapshot)
			}
		}
		if n.PollSnapshot {
			what = fmt.Sprintf("the snapshot strategy's progress, with %d rows already in the outbox %s", untracked, state)
			if n.ExistingPublished {
				l := n.Layout
				if l == nil {
					l = layout.Relay
				}
				byLease, err := leasePending(ctx, tx, outbox, l.Column(layout.EventID))
				if err != nil {
					return nil, err
				}
				if byLease >= 0 {
					what += fmt.Sprintf(", except the %d the lease strategy's state table holds as pending: they are published first, in its order", byLease)
				}
			}
		}
		objects = append(objects, struct{ what, exists, arg string }{what: what})
		existed = append(existed, false)
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

// leasePending counts the outbox rows without a transaction id that the
// lease strategy's state table holds as pending, which the snapshot
// strategy publishes first under --poll-existing published; -1 when the
// table has no lease state table.
func leasePending(ctx context.Context, tx pgx.Tx, outbox store.Table, eventID string) (int64, error) {
	poll, err := store.PollStateTable(outbox)
	if err != nil {
		return 0, err
	}
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", poll.Quoted()).Scan(&exists); err != nil {
		return 0, fmt.Errorf("look up poll state table %s: %w", poll, err)
	}
	if !exists {
		return -1, nil
	}
	snap, err := store.PollSnapshotTable(outbox)
	if err != nil {
		return 0, err
	}
	var count int64
	if err := tx.QueryRow(ctx, "SELECT CASE WHEN existing_pending THEN (SELECT count(*) FROM "+poll.Quoted()+" s JOIN "+outbox.Quoted()+
		" o ON o."+pgx.Identifier{eventID}.Sanitize()+" = s.event_id WHERE s.published_at IS NULL AND s.quarantined_at IS NULL AND o."+store.SnapshotXidColumn+" IS NULL) ELSE 0 END FROM "+
		snap.Quoted()).Scan(&count); err != nil {
		return 0, fmt.Errorf("count the rows the lease strategy holds as pending: %w", err)
	}
	return count, nil
}

// snapshotPending counts the lease state's pending rows when the table
// has the snapshot strategy's progress table, which --poll-existing
// published leaves pending where that progress does not cover them; -1
// without one.
func snapshotPending(ctx context.Context, tx pgx.Tx, outbox store.Table) (int64, error) {
	snap, err := store.PollSnapshotTable(outbox)
	if err != nil {
		return 0, err
	}
	poll, err := store.PollStateTable(outbox)
	if err != nil {
		return 0, err
	}
	var count int64
	if err := tx.QueryRow(ctx, "SELECT CASE WHEN to_regclass($1) IS NULL THEN -1 ELSE (SELECT count(*) FROM "+poll.Quoted()+" WHERE published_at IS NULL) END",
		snap.Quoted()).Scan(&count); err != nil {
		return 0, fmt.Errorf("count the rows the snapshot strategy had not published: %w", err)
	}
	return count, nil
}

// untrackedRows counts the outbox rows poll mode does not track yet, which
// the migration is about to add to its state table.
func untrackedRows(ctx context.Context, tx pgx.Tx, n Names, outboxExists bool) (int64, error) {
	outbox := store.Table{Schema: n.Schema, Name: n.Table}
	if n.PollSnapshot && outboxExists {
		return untrackedBySnapshot(ctx, tx, outbox)
	}
	if !n.Poll || !outboxExists {
		return 0, nil
	}
	poll, err := store.PollStateTable(outbox)
	if err != nil {
		return 0, err
	}
	query := "SELECT count(*) FROM " + outbox.Quoted()
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", poll.Quoted()).Scan(&exists); err != nil {
		return 0, fmt.Errorf("look up poll state table %s: %w", poll, err)
	}
	if exists {
		l := n.Layout
		if l == nil {
			l = layout.Relay
		}
		query += " o WHERE NOT EXISTS (SELECT 1 FROM " + poll.Quoted() + " s WHERE s.event_id = o." + pgx.Identifier{l.Column(layout.EventID)}.Sanitize() + ")"
	}
	var count int64
	if err := tx.QueryRow(ctx, query).Scan(&count); err != nil {
		return 0, fmt.Errorf("count outbox rows poll mode does not track yet: %w", err)
	}
	return count, nil
}
