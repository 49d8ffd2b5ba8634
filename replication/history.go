package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/store"
)

// What a slot's record says of the rows the outbox table held when the
// slot was made (the existing_rows column).
const (
	// ExistingNone: the table held no row, so nothing was left behind.
	ExistingNone = "none"
	// ExistingUnchecked: the role could not read the table to tell.
	ExistingUnchecked = "unchecked"
	// ExistingPublished: the operator chose --existing-rows published; the
	// rows committed before the slot were not published by it.
	ExistingPublished = "published"
	// ExistingPending: --existing-rows pending; every row committed before
	// the slot that Kafka lacked was republished from the table.
	ExistingPending = "pending"
	// ExistingRecovered: --on-slot-lost recover republished the lost
	// slot's gap.
	ExistingRecovered = "recovered"
	// ExistingAdopted: the slot existed before this record did (made by an
	// earlier version, by hand, or by a process killed before it wrote its
	// record); what it left behind is unknown.
	ExistingAdopted = "adopted"
)

// SlotRecord is the relay's own record, in PostgreSQL beside the outbox
// table, that it made a slot: what tells a lost history from a first start
// once the slot is gone.
type SlotRecord struct {
	Slot, Table string
	// LSN is the slot's consistent point, CreatedAt the server's clock
	// just before it was made.
	LSN       lsn.LSN
	CreatedAt time.Time
	// CreatedBy says which command made it: run, migrate, recovery.
	CreatedBy string
	// ExistingRows is one of the Existing* values.
	ExistingRows string
}

// SlotHistory is what PostgreSQL durably says of the slot's past.
type SlotHistory struct {
	// Record is the slot's record; nil when none was written.
	Record *SlotRecord
	// NoRegistry says the record table does not exist: `migrate` of this
	// version has not run, so a missing record proves nothing.
	NoRegistry bool
}

func (a *Admin) registry() (store.Table, error) {
	t, err := store.ParseTable("--table", a.cfg.Table)
	if err != nil {
		return store.Table{}, err
	}
	return store.SlotRegistry(t), nil
}

// History reads the slot's record.
func (a *Admin) History(ctx context.Context) (SlotHistory, error) {
	reg, err := a.registry()
	if err != nil {
		return SlotHistory{}, err
	}
	var rec SlotRecord
	var at string
	err = a.conn.QueryRow(ctx, "SELECT outbox_table, consistent_lsn::text, created_at, created_by, existing_rows FROM "+reg.Quoted()+" WHERE slot_name = $1",
		a.cfg.Slot).Scan(&rec.Table, &at, &rec.CreatedAt, &rec.CreatedBy, &rec.ExistingRows)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42P01": // undefined_table
		return SlotHistory{NoRegistry: true}, nil
	case errors.Is(err, pgx.ErrNoRows):
		return SlotHistory{}, nil
	case err != nil:
		return SlotHistory{}, fmt.Errorf("read the slot's record in %s: %w", reg, err)
	}
	rec.Slot = a.cfg.Slot
	if rec.LSN, err = lsn.Parse(at); err != nil {
		return SlotHistory{}, fmt.Errorf("read the slot's record in %s: %w", reg, err)
	}
	return SlotHistory{Record: &rec}, nil
}

// RecordSlot writes the slot's record, replacing an earlier one of the
// same name (a slot made again after a loss).
func (a *Admin) RecordSlot(ctx context.Context, rec SlotRecord) error {
	reg, err := a.registry()
	if err != nil {
		return err
	}
	_, err = a.conn.Exec(ctx, "INSERT INTO "+reg.Quoted()+` (slot_name, outbox_table, consistent_lsn, created_at, created_by, existing_rows)
		VALUES ($1, $2, $3::pg_lsn, $4, $5, $6)
		ON CONFLICT (slot_name) DO UPDATE SET outbox_table = EXCLUDED.outbox_table, consistent_lsn = EXCLUDED.consistent_lsn,
			created_at = EXCLUDED.created_at, created_by = EXCLUDED.created_by, existing_rows = EXCLUDED.existing_rows, recorded_at = now()`,
		a.cfg.Slot, a.cfg.Table, rec.LSN.String(), rec.CreatedAt, rec.CreatedBy, rec.ExistingRows)
	if err != nil {
		return fmt.Errorf("record slot %s in %s (run `outbox-relay migrate` as the schema's owner to create the table): %w", a.cfg.Slot, reg, err)
	}
	return nil
}

// Clock reads the server's clock: a slot made right after has its
// consistent point after it.
func (a *Admin) Clock(ctx context.Context) (time.Time, error) {
	var now time.Time
	if err := a.conn.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&now); err != nil {
		return now, fmt.Errorf("read the server's clock: %w", err)
	}
	return now, nil
}

// RowsBefore says what the outbox table holds now, for a slot about to
// be made: known is false when the role may not read the table.
func (a *Admin) RowsBefore(ctx context.Context) (rows TableRows, known bool, err error) {
	rows, err = a.ExistingRows(ctx)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege
		return rows, false, nil
	}
	return rows, err == nil, err
}

// ErrExistingRows marks a slot that would be made over rows no record
// says were published: a first start over rows written before the relay
// ran, or a lost history. Retrying cannot decide which; the operator must.
var ErrExistingRows = errors.New("the relay will not make a slot over rows it has no record of publishing")

// LostHistoryError says why a slot may not be made silently, and the
// choices that let the relay make it.
func LostHistoryError(cfg Config, why string, pendingNeedsRun bool) error {
	choices := fmt.Sprintf("Start the relay once with --existing-rows pending: it makes the slot together with a snapshot, compares every row of %s with Kafka and republishes those Kafka lacks, oldest first, then streams (slow on a large table; needs SELECT on it and its insert-time column, --column-created-at)", cfg.Table)
	if pendingNeedsRun {
		choices = "This command does not publish, so it leaves the slot to the relay. " + choices
	}
	return fmt.Errorf("%w: replication slot %q on %s: %s. The relay will not make a new slot over those rows without being told what they are. "+
		"%s; or with --on-slot-lost recover when a progress record or the slot's record says where the gap starts; "+
		"or with --existing-rows published, which makes the slot and publishes nothing committed before it (only if Kafka holds those events already: any it lacks are lost). See docs/slot-trouble.md",
		ErrExistingRows, cfg.Slot, pg.Describe(cfg.DSN), why, choices)
}

// WhyNotMake says why a slot that does not exist may not be made without
// the operator's choice: its record says it existed, or the table holds
// rows that no record covers. An empty table needs no choice: a new slot
// misses nothing a recovery could find. "" when it may be made, with what the table
// held (ExistingNone or ExistingUnchecked) for the new slot's record.
func (a *Admin) WhyNotMake(ctx context.Context, hist SlotHistory) (why, existing string, err error) {
	rows, known, err := a.RowsBefore(ctx)
	switch {
	case err != nil:
		return "", "", err
	case known && rows.Count == 0:
		// Whatever a lost slot left behind is in the table or nowhere: an
		// empty table leaves nothing to republish, whatever the record says.
		return "", ExistingNone, nil
	}
	if r := hist.Record; r != nil {
		return fmt.Sprintf("it does not exist, although %s made it at %s (consistent point %s) and recorded that in %s: it was dropped, or PostgreSQL failed over to a server without it, so events committed since may be in no slot",
			r.CreatedBy, r.CreatedAt.UTC().Format(time.RFC3339), r.LSN, store.SlotRegistryName), "", nil
	}
	if !known {
		return "", ExistingUnchecked, nil
	}
	newest := ""
	if !rows.NewestCreated.IsZero() {
		newest = ", the newest created at " + rows.NewestCreated.UTC().Format(time.RFC3339)
	}
	return fmt.Sprintf("it does not exist, no record says the relay ever made it, and %s holds %d rows%s: either this is a first start over rows written before the relay ran, or the slot's history was lost with its record",
		a.cfg.Table, rows.Count, newest), "", nil
}
