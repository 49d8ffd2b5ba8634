package replication

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrPrecondition marks a server or schema state the operator must fix; the
// relay does not retry it.
var ErrPrecondition = errors.New("precondition failed")

func precondition(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrPrecondition, fmt.Sprintf(format, args...))
}

// Admin is a plain (non-replication) connection for checks and slot
// management.
type Admin struct {
	conn *pgx.Conn
	cfg  Config
}

// Connect opens an Admin connection.
func Connect(ctx context.Context, cfg Config) (*Admin, error) {
	conn, err := Dial(ctx, cfg)
	if err != nil {
		return nil, err
	}
	return &Admin{conn: conn, cfg: cfg}, nil
}

// Dial opens a plain connection with the session settings the relay
// relies on (UTC ISO timestamps), a bounded connect time, and connection
// errors that say what to fix. Packages that keep their own tables use it
// instead of reaching into an Admin.
func Dial(ctx context.Context, cfg Config) (*pgx.Conn, error) {
	pc, err := pgx.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("parse --pg-dsn: %s", RedactError(err.Error(), cfg.DSN))
	}
	pinParams(pc.RuntimeParams, false)
	defaultConnectTimeout(&pc.Config)
	conn, err := pgx.ConnectConfig(ctx, pc)
	if err != nil {
		return nil, connectError(err, cfg.DSN)
	}
	return conn, nil
}

// Close closes the connection.
func (a *Admin) Close(ctx context.Context) error { return a.conn.Close(ctx) }

// defaultConnectTimeout bounds a connection attempt when the DSN does not
// (connect_timeout): a server that accepts TCP and never answers would
// otherwise hang the relay instead of sending it into its retry loop.
func defaultConnectTimeout(c *pgconn.Config) {
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 15 * time.Second
	}
}

// pinParams sets the session parameters decoding relies on (timestamps
// come out as ISO text in UTC) and the replication mode.
func pinParams(params map[string]string, replication bool) {
	delete(params, "replication")
	if replication {
		params["replication"] = "database"
	}
	params["timezone"] = "UTC"
	params["datestyle"] = "ISO, YMD"
	if params["application_name"] == "" {
		params["application_name"] = "outbox-relay"
	}
}

// connectError explains the connection failures an operator can meet.
func connectError(err error, dsn string) error {
	where := Describe(dsn)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case strings.Contains(pgErr.Message, "replication"):
			return precondition("connect to %s: %s: grant the role replication rights: ALTER ROLE <role> REPLICATION", where, pgErr.Message)
		case pgErr.Code == "42501":
			return precondition("connect to %s: %s: grant the role the right to connect: GRANT CONNECT ON DATABASE <database> TO <role>", where, pgErr.Message)
		case strings.Contains(pgErr.Message, "pg_hba.conf"):
			return precondition("connect to %s: %s: add a pg_hba.conf line 'host <database> <role> <relay address>/32 scram-sha-256' (logical replication connections match the database name, not the keyword replication) and reload PostgreSQL", where, pgErr.Message)
		case pgErr.Code == "28P01" || pgErr.Code == "28000":
			return precondition("connect to %s: %s: check the user and password in --pg-dsn", where, pgErr.Message)
		case pgErr.Code == "3D000":
			return precondition("connect to %s: %s: check the database name in --pg-dsn", where, pgErr.Message)
		}
	}
	return fmt.Errorf("connect to %s: %s", where, RedactError(err.Error(), dsn))
}

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
			ErrStandby, Describe(a.cfg.DSN))
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
		return precondition("wal_level is %q, the relay needs \"logical\": run ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL", walLevel)
	}
	var role string
	var canReplicate bool
	if err := a.conn.QueryRow(ctx,
		"SELECT current_user, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user").Scan(&role, &canReplicate); err != nil {
		return fmt.Errorf("read role attributes: %w", err)
	}
	if !canReplicate {
		return precondition("role %q lacks the REPLICATION attribute: run ALTER ROLE %s REPLICATION; as a superuser", role, quoteIdent(role))
	}
	if a.cfg.MessagePrefix != "" {
		return a.checkMessagesPublication(ctx)
	}
	schema, table, err := SplitTable(a.cfg.Table)
	if err != nil {
		return err
	}
	if err := RequireSchemaUsage(ctx, a.conn, schema); err != nil {
		return err
	}
	var exists bool
	if err := a.conn.QueryRow(ctx,
		"SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL", schema, table).Scan(&exists); err != nil {
		return fmt.Errorf("look up table %s: %w", a.cfg.Table, err)
	}
	if !exists {
		return precondition("table %s.%s does not exist: run `outbox-relay migrate` (or apply the README's SQL), or fix --table", schema, table)
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
		return precondition("publication %q does not exist: run `outbox-relay migrate` (or CREATE PUBLICATION %s FOR TABLE %s.%s WITH (publish = 'insert')), or fix --publication. "+
			"If it was dropped while the slot still had WAL to read, the slot cannot pass the changes written without it even once it exists again; the relay then stops with the steps to take",
			a.cfg.Publication, quoteIdent(a.cfg.Publication), quoteIdent(schema), quoteIdent(table))
	}
	if err != nil {
		return fmt.Errorf("look up publication %s: %w", a.cfg.Publication, err)
	}
	if !pubInsert {
		return precondition("publication %q does not publish inserts: ALTER PUBLICATION %s SET (publish = 'insert')", a.cfg.Publication, quoteIdent(a.cfg.Publication))
	}
	if partitioned && !viaRoot {
		// Without it the stream names each partition, never the table,
		// and pg_publication_tables lists only the partitions: ADD TABLE
		// would be refused, as the table is a member already.
		return precondition("table %s.%s is partitioned, and publication %q publishes its partitions under their own names: ALTER PUBLICATION %s SET (publish_via_partition_root = true); as the publication's owner, so the rows arrive as the table's",
			schema, table, a.cfg.Publication, quoteIdent(a.cfg.Publication))
	}
	var included bool
	if err := a.conn.QueryRow(ctx,
		"SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
		a.cfg.Publication, schema, table).Scan(&included); err != nil {
		return fmt.Errorf("read publication tables: %w", err)
	}
	if !included {
		return precondition("publication %q does not include table %s.%s: ALTER PUBLICATION %s ADD TABLE %s.%s",
			a.cfg.Publication, schema, table, quoteIdent(a.cfg.Publication), quoteIdent(schema), quoteIdent(table))
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
		return precondition("PostgreSQL %d.%d sends no logical decoding messages to pgoutput (14 and later do): use --source wal with an outbox table, or upgrade", version/10000, version%10000)
	}
	var exists bool
	if err := a.conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", a.cfg.Publication).Scan(&exists); err != nil {
		return fmt.Errorf("look up publication %s: %w", a.cfg.Publication, err)
	}
	if !exists {
		return precondition("publication %q does not exist: run `outbox-relay migrate --source messages` (or CREATE PUBLICATION %s; it needs no table), or fix --publication",
			a.cfg.Publication, quoteIdent(a.cfg.Publication))
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
