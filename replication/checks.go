package replication

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// ErrPrecondition marks a server or schema state the operator must fix; the
// relay does not retry it.
var ErrPrecondition = errors.New("precondition failed")

// ErrSlotLost marks a slot the server invalidated: the WAL it held is gone.
var ErrSlotLost = errors.New("replication slot invalidated")

// ErrSlotBusy marks a slot another process is streaming from.
var ErrSlotBusy = errors.New("replication slot in use")

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
	return &Admin{conn: conn, cfg: cfg}, nil
}

// Conn exposes the connection for callers that run their own SQL (migrate).
func (a *Admin) Conn() *pgx.Conn { return a.conn }

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
		case pgErr.Code == "42501" || strings.Contains(pgErr.Message, "replication role"):
			return precondition("connect to %s: %s: grant the role replication rights: ALTER ROLE <role> REPLICATION", where, pgErr.Message)
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
	schema, table, err := SplitTable(a.cfg.Table)
	if err != nil {
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
	var pubInsert, allTables bool
	err = a.conn.QueryRow(ctx, "SELECT pubinsert, puballtables FROM pg_publication WHERE pubname = $1", a.cfg.Publication).Scan(&pubInsert, &allTables)
	if errors.Is(err, pgx.ErrNoRows) {
		return precondition("publication %q does not exist: run `outbox-relay migrate` (or CREATE PUBLICATION %s FOR TABLE %s.%s WITH (publish = 'insert')), or fix --publication",
			a.cfg.Publication, quoteIdent(a.cfg.Publication), quoteIdent(schema), quoteIdent(table))
	}
	if err != nil {
		return fmt.Errorf("look up publication %s: %w", a.cfg.Publication, err)
	}
	if !pubInsert {
		return precondition("publication %q does not publish inserts: ALTER PUBLICATION %s SET (publish = 'insert')", a.cfg.Publication, quoteIdent(a.cfg.Publication))
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
	return nil
}

// SlotInfo is the server's view of the slot, from pg_replication_slots.
type SlotInfo struct {
	Name              string   `json:"slot_name"`
	Plugin            string   `json:"plugin"`
	Database          string   `json:"database"`
	Active            bool     `json:"active"`
	ActivePID         *int     `json:"active_pid"`
	RestartLSN        *string  `json:"restart_lsn"`
	ConfirmedFlushLSN *string  `json:"confirmed_flush_lsn"`
	WALStatus         *string  `json:"wal_status"`
	SafeWALSize       *int64   `json:"safe_wal_size"`
	Failover          *bool    `json:"failover,omitempty"`
	CurrentLSN        string   `json:"current_wal_lsn"`
	RetainedWALBytes  *float64 `json:"retained_wal_bytes"`
	LagBytes          *float64 `json:"lag_bytes"`
}

// Confirmed returns the slot's confirmed_flush_lsn.
func (s *SlotInfo) Confirmed() (lsn.LSN, error) {
	if s.ConfirmedFlushLSN == nil {
		return 0, fmt.Errorf("slot %s has no confirmed_flush_lsn", s.Name)
	}
	return lsn.Parse(*s.ConfirmedFlushLSN)
}

// Lost reports whether the server invalidated the slot.
func (s *SlotInfo) Lost() bool {
	return s.WALStatus != nil && *s.WALStatus == "lost" || s.RestartLSN == nil && s.Plugin != ""
}

// Slot reads the slot's state; ok is false when it does not exist. It reads
// the row as JSON so it works across server versions whose views differ.
func (a *Admin) Slot(ctx context.Context) (info *SlotInfo, ok bool, err error) {
	var raw []byte
	err = a.conn.QueryRow(ctx, `
		SELECT to_jsonb(s) || jsonb_build_object(
			'current_wal_lsn', pg_current_wal_lsn()::text,
			'retained_wal_bytes', pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn),
			'lag_bytes', pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn))
		FROM pg_replication_slots s WHERE slot_name = $1`, a.cfg.Slot).Scan(&raw)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("read slot %s: %w", a.cfg.Slot, err)
	}
	info = &SlotInfo{}
	if err := json.Unmarshal(raw, info); err != nil {
		return nil, false, fmt.Errorf("decode slot %s: %w", a.cfg.Slot, err)
	}
	return info, true, nil
}

// CreateSlot creates the permanent pgoutput slot. From this moment on the
// slot holds every committed change for the relay.
func (a *Admin) CreateSlot(ctx context.Context) (lsn.LSN, error) {
	query := "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
	if a.cfg.SlotFailover {
		if err := a.requireFailoverSupport(ctx); err != nil {
			return 0, err
		}
		query = "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
	}
	var at string
	if err := a.conn.QueryRow(ctx, query, a.cfg.Slot).Scan(&at); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42710" {
			return 0, fmt.Errorf("create slot %s: it was created concurrently: %w", a.cfg.Slot, err)
		}
		return 0, fmt.Errorf("create slot %s: %w (check max_replication_slots and the role's REPLICATION attribute)", a.cfg.Slot, err)
	}
	return lsn.Parse(at)
}

// CheckSlot verifies an existing slot can serve the relay.
func (a *Admin) CheckSlot(ctx context.Context, info *SlotInfo) error {
	if info.Lost() {
		return fmt.Errorf("%w: slot %q has wal_status=lost: PostgreSQL removed WAL it still needed (max_slot_wal_keep_size), so events committed while the relay was behind may never reach Kafka. "+
			"Reconcile the outbox table against Kafka for that period, then drop the slot (SELECT pg_drop_replication_slot('%s')) and start the relay with --recreate-lost-slot, or run migrate",
			ErrSlotLost, info.Name, info.Name)
	}
	if info.Plugin != "pgoutput" {
		return precondition("slot %q uses plugin %q, the relay needs pgoutput: choose another --slot, or drop this one", info.Name, info.Plugin)
	}
	var db string
	if err := a.conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		return fmt.Errorf("read current database: %w", err)
	}
	if info.Database != db {
		return precondition("slot %q belongs to database %q, not %q: choose another --slot", info.Name, info.Database, db)
	}
	if a.cfg.SlotFailover {
		if err := a.requireFailoverSupport(ctx); err != nil {
			return err
		}
		if info.Failover == nil || !*info.Failover {
			return precondition("--slot-failover is set but slot %q is not a failover slot: run ALTER_REPLICATION_SLOT %s (FAILOVER true) on a replication connection, or drop the slot and run `outbox-relay migrate --slot-failover`",
				info.Name, quoteIdent(info.Name))
		}
	}
	return nil
}

// requireFailoverSupport refuses --slot-failover on servers before 17.
func (a *Admin) requireFailoverSupport(ctx context.Context) error {
	var version int
	if err := a.conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return fmt.Errorf("read server version: %w", err)
	}
	if version < 170000 {
		return precondition("--slot-failover needs PostgreSQL 17 or newer; this server is %d.%d: drop the flag, or upgrade", version/10000, version%10000/100)
	}
	return nil
}

// DropSlot drops the slot. Only an explicit operator flag leads here.
func (a *Admin) DropSlot(ctx context.Context) error {
	if _, err := a.conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", a.cfg.Slot); err != nil {
		return fmt.Errorf("drop slot %s: %w", a.cfg.Slot, err)
	}
	return nil
}

// CountRows counts the outbox table's rows, for the warning when the relay
// has to create the slot itself.
func (a *Admin) CountRows(ctx context.Context) (int64, error) {
	schema, table, err := SplitTable(a.cfg.Table)
	if err != nil {
		return 0, err
	}
	var n int64
	err = a.conn.QueryRow(ctx, fmt.Sprintf("SELECT count(*) FROM %s.%s", quoteIdent(schema), quoteIdent(table))).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count rows of %s: %w", a.cfg.Table, err)
	}
	return n, nil
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
