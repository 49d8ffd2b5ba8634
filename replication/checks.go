package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/pg"
)

// Admin is a plain (non-replication) connection for checks and slot
// management.
type Admin struct {
	conn *pgx.Conn
	cfg  Config
}

// Connect opens an Admin connection.
func Connect(ctx context.Context, cfg Config) (*Admin, error) {
	conn, err := pg.Dial(ctx, cfg.Config)
	if err != nil {
		return nil, err
	}
	return &Admin{conn: conn, cfg: cfg}, nil
}

// Close closes the connection.
func (a *Admin) Close(ctx context.Context) error { return a.conn.Close(ctx) }

// ErrStandby marks a server in recovery, a hot standby: it refuses
// pg_current_wal_lsn() and writes, so the relay cannot stream from it until
// it is promoted. Waiting for that is not an error the operator must fix.
var ErrStandby = errors.New("server is a standby")

// RequirePrimary refuses a server in recovery with ErrStandby, naming it.
func (a *Admin) RequirePrimary(ctx context.Context) error {
	var inRecovery bool
	if err := a.conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil {
		return fmt.Errorf("read pg_is_in_recovery(): %w", err)
	}
	if inRecovery {
		return fmt.Errorf("%w: %s is a hot standby (pg_is_in_recovery() is true) and the relay streams from a primary: waiting for it to be promoted. "+
			"If it should not be, point --pg-dsn at the primary, or list every server in it with target_session_attrs=read-write",
			ErrStandby, pg.Describe(a.cfg.DSN))
	}
	return nil
}

// Check verifies everything streaming needs and says what to change when
// something is missing.
func (a *Admin) Check(ctx context.Context) error {
	var walLevel string
	if err := a.conn.QueryRow(ctx, "SHOW wal_level").Scan(&walLevel); err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if walLevel != "logical" {
		return pg.Preconditionf("wal_level is %q, the relay needs \"logical\": run ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL", walLevel)
	}
	var role string
	var canReplicate bool
	if err := a.conn.QueryRow(ctx,
		"SELECT current_user, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user").Scan(&role, &canReplicate); err != nil {
		return fmt.Errorf("read role attributes: %w", err)
	}
	if !canReplicate {
		return pg.Preconditionf("role %q lacks the REPLICATION attribute: run ALTER ROLE %s REPLICATION; as a superuser", role, pg.QuoteIdent(role))
	}
	return a.cfg.source().check(ctx, a)
}

// checkTable checks what the table source needs besides replication: the
// outbox table, its columns, and a publication of its inserts.
func (a *Admin) checkTable(ctx context.Context) error {
	schema, table, err := pg.SplitTable(a.cfg.Table)
	if err != nil {
		return err
	}
	if err := pg.RequireSchemaUsage(ctx, a.conn, schema); err != nil {
		return err
	}
	var exists bool
	if err := a.conn.QueryRow(ctx,
		"SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL", schema, table).Scan(&exists); err != nil {
		return fmt.Errorf("look up table %s: %w", a.cfg.Table, err)
	}
	if !exists {
		return pg.Preconditionf("table %s.%s does not exist: run `outbox-relay migrate` (or apply the SQL of outbox-relay migrate --print-sql), or fix --table", schema, table)
	}
	var partitioned bool
	if err := a.conn.QueryRow(ctx,
		"SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(format('%I.%I', $1::text, $2::text))", schema, table).Scan(&partitioned); err != nil {
		return fmt.Errorf("look up table %s: %w", a.cfg.Table, err)
	}
	var pubInsert, allTables, viaRoot bool
	// pubviaroot exists from PostgreSQL 13, which publishing a partitioned
	// table needs anyway.
	viaRootColumn := "false"
	if partitioned {
		viaRootColumn = "pubviaroot"
	}
	err = a.conn.QueryRow(ctx, "SELECT pubinsert, puballtables, "+viaRootColumn+" FROM pg_publication WHERE pubname = $1",
		a.cfg.Publication).Scan(&pubInsert, &allTables, &viaRoot)
	if errors.Is(err, pgx.ErrNoRows) {
		return pg.Preconditionf("publication %q does not exist: run `outbox-relay migrate` (or CREATE PUBLICATION %s FOR TABLE %s.%s WITH (publish = 'insert')), or fix --publication. "+
			"If it was dropped while the slot still had WAL to read, the slot cannot pass the changes written without it even once it exists again; the relay then stops with the steps to take",
			a.cfg.Publication, pg.QuoteIdent(a.cfg.Publication), pg.QuoteIdent(schema), pg.QuoteIdent(table))
	}
	if err != nil {
		return fmt.Errorf("look up publication %s: %w", a.cfg.Publication, err)
	}
	if !pubInsert {
		return pg.Preconditionf("publication %q does not publish inserts: ALTER PUBLICATION %s SET (publish = 'insert')", a.cfg.Publication, pg.QuoteIdent(a.cfg.Publication))
	}
	if partitioned && !viaRoot {
		// Without it the stream names each partition, never the table,
		// and pg_publication_tables lists only the partitions: ADD TABLE
		// would be refused, as the table is a member already.
		return pg.Preconditionf("table %s.%s is partitioned, and publication %q publishes its partitions under their own names: ALTER PUBLICATION %s SET (publish_via_partition_root = true); as the publication's owner, so the rows arrive as the table's",
			schema, table, a.cfg.Publication, pg.QuoteIdent(a.cfg.Publication))
	}
	var included bool
	if err := a.conn.QueryRow(ctx,
		"SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
		a.cfg.Publication, schema, table).Scan(&included); err != nil {
		return fmt.Errorf("read publication tables: %w", err)
	}
	if !included {
		return pg.Preconditionf("publication %q does not include table %s.%s: ALTER PUBLICATION %s ADD TABLE %s.%s",
			a.cfg.Publication, schema, table, pg.QuoteIdent(a.cfg.Publication), pg.QuoteIdent(schema), pg.QuoteIdent(table))
	}
	return a.CheckColumns(ctx)
}

// checkMessagesPublication checks what the messages source needs besides
// replication: a server that sends messages over protocol version 1, and
// the publication pgoutput must be given, which may publish no table.
func (a *Admin) checkMessagesPublication(ctx context.Context) error {
	var version int
	if err := a.conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return fmt.Errorf("read server_version_num: %w", err)
	}
	if version < 140000 {
		return pg.Preconditionf("PostgreSQL %d.%d sends no logical decoding messages to pgoutput (14 and later do): use --source wal with an outbox table, or upgrade", version/10000, version%10000)
	}
	var exists bool
	if err := a.conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", a.cfg.Publication).Scan(&exists); err != nil {
		return fmt.Errorf("look up publication %s: %w", a.cfg.Publication, err)
	}
	if !exists {
		return pg.Preconditionf("publication %q does not exist: run `outbox-relay migrate --source messages` (or CREATE PUBLICATION %s; it needs no table), or fix --publication",
			a.cfg.Publication, pg.QuoteIdent(a.cfg.Publication))
	}
	return nil
}

// SenderTimeout reads wal_sender_timeout: status updates must come well
// inside it or the server drops the connection. Zero means disabled.
func (a *Admin) SenderTimeout(ctx context.Context) (time.Duration, error) {
	var ms int64
	if err := a.conn.QueryRow(ctx, "SELECT setting::bigint FROM pg_settings WHERE name = 'wal_sender_timeout'").Scan(&ms); err != nil {
		return 0, fmt.Errorf("read wal_sender_timeout: %w", err)
	}
	return time.Duration(ms) * time.Millisecond, nil
}

// CheckNoPollers refuses to stream the table while a poller runs on it
// (see pg.CheckNoPollers).
func (a *Admin) CheckNoPollers(ctx context.Context) error {
	return pg.CheckNoPollers(ctx, a.conn, a.cfg.Config)
}
