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

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pg"
)

// ErrSlotLost marks a slot the server invalidated: the WAL it held is gone.
var ErrSlotLost = errors.New("replication slot invalidated")

// ErrSlotMissing marks a slot that vanished after this process streamed
// from it: dropped, or the server failed over to one without the slot. The
// events committed since the last confirmed position are not in any slot.
var ErrSlotMissing = errors.New("replication slot disappeared")

// ErrSlotBusy marks a slot another process is streaming from.
var ErrSlotBusy = errors.New("replication slot in use")

// SlotPolicy is what the relay may do about its slot before streaming.
type SlotPolicy struct {
	// RecreateLost drops and recreates a slot the server invalidated. The
	// events in the removed WAL are not delivered.
	RecreateLost bool
	// MustExist is set once this process has streamed from the slot: from
	// then on a missing slot means events were lost, and creating a new one
	// at the current position would hide that.
	MustExist bool
	// LastConfirmedCommit is the commit time of the last transaction this
	// process confirmed, named in the error when the slot is missing so the
	// operator knows where the gap starts. Zero when unknown.
	LastConfirmedCommit time.Time
	// BeforeCreate, when set, runs before a slot is created (or a lost one
	// dropped to be recreated); its error leaves the slot as it was.
	BeforeCreate func(context.Context) error
}

// SlotStart is where a session starts streaming, and what happened to the
// slot on the way.
type SlotStart struct {
	LSN lsn.LSN
	// Created is set when the slot did not exist and was created now, at
	// LSN: rows committed before it are not in the slot.
	Created bool
	// RecreatedLost is set when an invalidated slot was dropped and
	// created again under RecreateLost.
	RecreatedLost bool
}

// PrepareSlot applies the slot policy: it creates the slot at first start,
// recreates a lost one only when allowed, refuses a missing one once this
// process streamed from it, refuses one another process is streaming from,
// and returns where to start.
func (a *Admin) PrepareSlot(ctx context.Context, policy SlotPolicy) (SlotStart, error) {
	slot, exists, err := a.Slot(ctx)
	if err != nil {
		return SlotStart{}, err
	}
	if !exists && policy.MustExist {
		return SlotStart{}, a.missingSlotError(policy.LastConfirmedCommit)
	}
	create := !exists || (slot.Lost() && policy.RecreateLost)
	if create && policy.BeforeCreate != nil {
		if err := policy.BeforeCreate(ctx); err != nil {
			return SlotStart{}, err
		}
	}
	var start SlotStart
	if exists && slot.Lost() && policy.RecreateLost {
		if err := a.DropSlot(ctx); err != nil {
			return SlotStart{}, err
		}
		exists, start.RecreatedLost = false, true
	}
	if !exists {
		at, err := a.CreateSlot(ctx)
		if err != nil {
			return SlotStart{}, err
		}
		start.LSN, start.Created = at, true
		return start, nil
	}
	if err := a.CheckSlot(ctx, slot); err != nil {
		return SlotStart{}, err
	}
	if slot.Active {
		// Another process streams it. Say so before the caller connects to
		// Kafka, so a standby does not open a producer on every poll;
		// START_REPLICATION remains the real lock.
		pid := 0
		if slot.ActivePID != nil {
			pid = *slot.ActivePID
		}
		return SlotStart{}, fmt.Errorf("%w: replication slot %q is active for PID %d", ErrSlotBusy, slot.Name, pid)
	}
	start.LSN, err = slot.Confirmed()
	return start, err
}

func (a *Admin) missingSlotError(lastConfirmedCommit time.Time) error {
	since := "<commit time of the last transaction this relay confirmed>"
	if !lastConfirmedCommit.IsZero() {
		since = lastConfirmedCommit.UTC().Format(time.RFC3339)
	}
	advice := fmt.Sprintf("Run `%s` to create the slot again; %s", a.cfg.source().Migrate(), a.cfg.GapAdvice(since))
	if a.cfg.ReadsTable() {
		// Each way makes the new slot before it reads the table, so what
		// the writers commit meanwhile is not missed.
		advice = fmt.Sprintf("Start the relay once with --on-slot-lost recover (it republishes from the outbox table what Kafka lacks since %s) or --existing-rows pending (the whole table); see docs/slot-trouble.md", since)
	}
	return fmt.Errorf("%w: replication slot %q no longer exists on %s although this relay streamed from it: it was dropped, or PostgreSQL failed over to a server without it, "+
		"so events committed since the last confirmed position are in no slot and will not reach Kafka. The relay will not create a new slot silently. %s",
		ErrSlotMissing, a.cfg.Slot, pg.Describe(a.cfg.DSN), advice)
}

// TableRows describes what the outbox table holds when a slot is created:
// those rows committed before the slot and are not in it.
type TableRows struct {
	Count int64
	// NewestCreated and OldestCreated are the newest and oldest rows'
	// created_at; zero when the table is empty or has no created_at column.
	NewestCreated, OldestCreated time.Time
}

// ExistingRows reads how many rows the outbox table holds and how new the
// newest is. Rows an earlier slot already published are counted too, so
// the count alone does not say anything was missed; the newest row's age
// does: a row created long before the slot was most likely published.
func (a *Admin) ExistingRows(ctx context.Context) (TableRows, error) {
	schema, table, err := pg.SplitTable(a.cfg.Table)
	if err != nil {
		return TableRows{}, err
	}
	qualified := pgx.Identifier{schema, table}.Sanitize()
	var rows TableRows
	var newest, oldest *time.Time
	created := pgx.Identifier{a.cfg.OutboxLayout().Column(layout.CreatedAt)}.Sanitize()
	err = a.conn.QueryRow(ctx, "SELECT count(*), max("+created+"), min("+created+") FROM "+qualified).Scan(&rows.Count, &newest, &oldest)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42703" { // no insert-time column: custom table
		err = a.conn.QueryRow(ctx, "SELECT count(*) FROM "+qualified).Scan(&rows.Count)
	}
	if err != nil {
		return TableRows{}, fmt.Errorf("count rows of %s: %w", a.cfg.Table, err)
	}
	if newest != nil {
		rows.NewestCreated = *newest
	}
	if oldest != nil {
		rows.OldestCreated = *oldest
	}
	return rows, nil
}

// SlotInfo is the server's view of the slot, from pg_replication_slots.
type SlotInfo struct {
	Name              string  `json:"slot_name"`
	Plugin            string  `json:"plugin"`
	Database          string  `json:"database"`
	Active            bool    `json:"active"`
	ActivePID         *int    `json:"active_pid"`
	RestartLSN        *string `json:"restart_lsn"`
	ConfirmedFlushLSN *string `json:"confirmed_flush_lsn"`
	WALStatus         *string `json:"wal_status"`
	SafeWALSize       *int64  `json:"safe_wal_size"`
	Failover          *bool   `json:"failover,omitempty"`
	// InvalidationReason is why the server invalidated the slot
	// (PostgreSQL 17+): wal_removed, rows_removed, wal_level_insufficient,
	// or idle_timeout (18).
	InvalidationReason *string `json:"invalidation_reason,omitempty"`
	Temporary          bool    `json:"temporary"`
	// InactiveSince is when the slot was last released (PostgreSQL 17+),
	// what idle_replication_slot_timeout counts from; nil while active.
	InactiveSince *time.Time `json:"inactive_since,omitempty"`
	// Synced marks, on a standby (PostgreSQL 17+), a slot copied from the
	// primary by slot synchronisation.
	Synced           *bool    `json:"synced,omitempty"`
	CurrentLSN       string   `json:"current_wal_lsn"`
	RetainedWALBytes *float64 `json:"retained_wal_bytes"`
	LagBytes         *float64 `json:"lag_bytes"`
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
	return s.WALStatus != nil && *s.WALStatus == "lost" || s.RestartLSN == nil && s.Plugin != "" ||
		s.InvalidationReason != nil
}

// Invalidation says how the server shows the slot invalidated
// (invalidation_reason on 17+, wal_status) and what that means; "" when the
// slot is not lost.
func (s *SlotInfo) Invalidation() string {
	if !s.Lost() {
		return ""
	}
	var shown []string
	if s.InvalidationReason != nil {
		shown = append(shown, "invalidation_reason="+*s.InvalidationReason)
	}
	if s.WALStatus != nil {
		shown = append(shown, "wal_status="+*s.WALStatus)
	}
	why := "PostgreSQL removed WAL it still needed (max_slot_wal_keep_size)"
	if s.InvalidationReason != nil {
		switch *s.InvalidationReason {
		case "idle_timeout":
			why = "no relay streamed from it for longer than idle_replication_slot_timeout"
		case "rows_removed":
			why = "catalog rows it needed were removed (on a standby: turn hot_standby_feedback on and use a physical slot)"
		case "wal_level_insufficient":
			why = "wal_level on the primary was lowered below logical"
		case "wal_removed":
		default:
			why = "PostgreSQL invalidated it"
		}
	}
	return strings.Join(shown, ", ") + ": " + why
}

// Slot reads the slot's state; ok is false when it does not exist. It reads
// the row as JSON so it works across server versions whose views differ.
// On a standby, which refuses pg_current_wal_lsn(), the WAL position is the
// last one replayed.
func (a *Admin) Slot(ctx context.Context) (info *SlotInfo, ok bool, err error) {
	var raw []byte
	err = a.conn.QueryRow(ctx, `
		WITH w AS (SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END AS lsn)
		SELECT to_jsonb(s) || jsonb_build_object(
			'current_wal_lsn', w.lsn::text,
			'retained_wal_bytes', pg_wal_lsn_diff(w.lsn, s.restart_lsn),
			'lag_bytes', pg_wal_lsn_diff(w.lsn, s.confirmed_flush_lsn))
		FROM pg_replication_slots s, w WHERE slot_name = $1`, a.cfg.Slot).Scan(&raw)
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
		return fmt.Errorf("%w: slot %q is invalidated (%s), so events committed while the relay was behind or down may never reach Kafka. %s",
			ErrSlotLost, info.Name, info.Invalidation(), a.cfg.lostSlotAdvice(info.Name))
	}
	if info.Plugin != "pgoutput" {
		return pg.Preconditionf("slot %q uses plugin %q, the relay needs pgoutput: choose another --slot, or drop this one", info.Name, info.Plugin)
	}
	var db string
	if err := a.conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		return fmt.Errorf("read current database: %w", err)
	}
	if info.Database != db {
		return pg.Preconditionf("slot %q belongs to database %q, not %q: choose another --slot", info.Name, info.Database, db)
	}
	if a.cfg.SlotFailover {
		if err := a.requireFailoverSupport(ctx); err != nil {
			return err
		}
		if info.Failover == nil || !*info.Failover {
			return pg.Preconditionf("--slot-failover is set but slot %q is not a failover slot: run ALTER_REPLICATION_SLOT %s (FAILOVER true) on a replication connection, or drop the slot and run `outbox-relay migrate --slot-failover`",
				info.Name, pg.QuoteIdent(info.Name))
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
		return pg.Preconditionf("--slot-failover needs PostgreSQL 17 or newer; this server is %s: drop the flag, or upgrade", releaseName(version))
	}
	return nil
}

// releaseName spells server_version_num as PostgreSQL names the release:
// 150018 is 15.18; before version 10 the minor had two places, 90624 is
// 9.6.24.
func releaseName(versionNum int) string {
	if versionNum >= 100000 {
		return fmt.Sprintf("%d.%d", versionNum/10000, versionNum%10000)
	}
	return fmt.Sprintf("%d.%d.%d", versionNum/10000, versionNum/100%100, versionNum%100)
}

// DropSlot drops the slot. Only an explicit operator flag leads here.
func (a *Admin) DropSlot(ctx context.Context) error {
	if _, err := a.conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", a.cfg.Slot); err != nil {
		return fmt.Errorf("drop slot %s: %w", a.cfg.Slot, err)
	}
	return nil
}

// FailoverWarning says why the slot would not survive a failover, when the
// server shows it; "" otherwise. A standby synchronises a failover slot
// only once the primary's slot has moved past the WAL the standby keeps
// (until then PostgreSQL logs "could not synchronize replication slot"
// and keeps a temporary copy that promotion drops), and only a consumer
// moves a slot. On the primary that shows as a failover slot nobody
// streams from that has decoded no transaction; on a standby, as the slot
// missing or temporary. exists says whether info was found.
func (a *Admin) FailoverWarning(ctx context.Context, info *SlotInfo, exists bool) (string, error) {
	var inRecovery bool
	if err := a.conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil {
		return "", fmt.Errorf("read pg_is_in_recovery(): %w", err)
	}
	const fix = "start the relay on the primary: once it streams, the slot moves and the standby synchronises it within seconds (see \"PostgreSQL standbys and failover\" in docs/postgres-failover.md)"
	if inRecovery {
		switch {
		case !exists:
			return fmt.Sprintf("slot %q is not on this standby: a failover to it would lose the slot. It must be a failover slot (`migrate --slot-failover`, PostgreSQL 17+) and this standby needs sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name and a dbname in primary_conninfo; if all that is so, %s", a.cfg.Slot, fix), nil
		case info.Synced != nil && *info.Synced && info.Temporary:
			return fmt.Sprintf("slot %q is not synchronised to this standby yet (a temporary copy, which promotion drops; the standby logs \"could not synchronize replication slot\"): the slot on the primary has not moved past the WAL this standby keeps; %s", a.cfg.Slot, fix), nil
		}
		return "", nil
	}
	if !exists || info.Failover == nil || !*info.Failover || info.Active {
		return "", nil
	}
	var txns int64
	if err := a.conn.QueryRow(ctx, "SELECT coalesce((SELECT total_txns FROM pg_stat_replication_slots WHERE slot_name = $1), 0)", a.cfg.Slot).Scan(&txns); err != nil {
		return "", fmt.Errorf("read pg_stat_replication_slots: %w", err)
	}
	if txns > 0 {
		return "", nil
	}
	return fmt.Sprintf("failover slot %q has decoded no transaction since it was created (or since its statistics were reset) and nothing streams from it: a standby cannot synchronise a slot that does not move (it logs \"could not synchronize replication slot\"), so a failover now would lose it; %s", a.cfg.Slot, fix), nil
}
