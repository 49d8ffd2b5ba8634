package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/pg"
)

// PartitionRegistryName is the table, in the outbox table's schema (the
// --table schema for the messages source), where the relay records the
// partition count each event topic's keys are mapped by
// (migrations/010_partitions.sql).
const PartitionRegistryName = "outbox_relay_partitions"

// PartitionRegistry returns the table that records the event topics'
// partition counts for an outbox table: outbox_relay_partitions in its
// schema, shared by the schema's relays, one row a topic.
func PartitionRegistry(outbox Table) Table {
	return Table{Schema: outbox.Schema, Name: PartitionRegistryName}
}

// Partitions reads and writes the partition count registry.
type Partitions struct {
	cfg   pg.Config
	table Table
}

// NewPartitions is the registry beside cfg's outbox table.
func NewPartitions(cfg pg.Config) (*Partitions, error) {
	outbox, err := ParseTable("--table", cfg.Table)
	if err != nil {
		return nil, err
	}
	return &Partitions{cfg: cfg, table: PartitionRegistry(outbox)}, nil
}

// Table is the registry's table.
func (p *Partitions) Table() Table { return p.table }

// Pin returns the count recorded for topic, first recording actual when
// none is; recorded says this call recorded it. It connects for the call:
// the relay asks once per topic and session, never per record.
func (p *Partitions) Pin(ctx context.Context, topic string, actual int32) (n int32, recorded bool, err error) {
	conn, err := pg.Dial(ctx, p.cfg)
	if err != nil {
		return 0, false, err
	}
	defer conn.Close(context.Background())
	tag, err := conn.Exec(ctx, "INSERT INTO "+p.table.Quoted()+" (topic, partitions, recorded_by) VALUES ($1, $2, 'run') ON CONFLICT (topic) DO NOTHING",
		topic, actual)
	if err != nil {
		return 0, false, p.explain(err)
	}
	// FOR SHARE waits for an adoption under way (partitions adopt holds
	// the row) and reads what it committed.
	if err := conn.QueryRow(ctx, "SELECT partitions FROM "+p.table.Quoted()+" WHERE topic = $1 FOR SHARE", topic).Scan(&n); err != nil {
		return 0, false, p.explain(err)
	}
	return n, tag.RowsAffected() == 1, nil
}

// Recorded returns the count recorded for topic, 0 when none is, and
// writes nothing: for the dry run, which maps keys as the relay would
// without recording a count. It connects for the call.
func (p *Partitions) Recorded(ctx context.Context, topic string) (int32, error) {
	conn, err := pg.Dial(ctx, p.cfg)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var n int32
	err = conn.QueryRow(ctx, "SELECT partitions FROM "+p.table.Quoted()+" WHERE topic = $1", topic).Scan(&n)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, p.explain(err)
	}
	return n, nil
}

// Check says whether the registry exists, with the error a relay that
// publishes without it stops with (explain's).
func (p *Partitions) Check(ctx context.Context, conn *pgx.Conn) error {
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", p.table.Quoted()).Scan(&exists); err != nil {
		return fmt.Errorf("partition count registry %s: %w", p.table, err)
	}
	if !exists {
		return p.explain(&pgconn.PgError{Code: "42P01"})
	}
	return nil
}

// explain says what to do about a missing registry: a relay upgraded
// without running migrate.
func (p *Partitions) explain(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
		return pg.Preconditionf("the partition count registry %s does not exist: run `outbox-relay migrate` with the relay's flags (it creates only what is missing), then start the relay again", p.table)
	}
	return fmt.Errorf("partition count registry %s: %w", p.table, err)
}

// RecordedTopic is one row of the registry.
type RecordedTopic struct {
	Topic      string    `json:"topic"`
	Partitions int32     `json:"partitions_recorded"`
	RecordedAt time.Time `json:"recorded_at"`
	RecordedBy string    `json:"recorded_by"`
	Previous   *int32    `json:"previous,omitempty"`
}

// List returns every recorded topic, by name.
func (p *Partitions) List(ctx context.Context, conn *pgx.Conn) ([]RecordedTopic, error) {
	rows, err := conn.Query(ctx, "SELECT topic, partitions, recorded_at, recorded_by, previous FROM "+p.table.Quoted()+" ORDER BY topic")
	if err != nil {
		return nil, p.explain(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (RecordedTopic, error) {
		var t RecordedTopic
		err := r.Scan(&t.Topic, &t.Partitions, &t.RecordedAt, &t.RecordedBy, &t.Previous)
		return t, err
	})
	if err != nil {
		return nil, p.explain(err)
	}
	return out, nil
}

// Adopt records n as topic's count in tx, the caller's transaction, and
// returns the count it replaces (0: none was recorded).
func (p *Partitions) Adopt(ctx context.Context, tx pgx.Tx, topic string, n int32) (int32, error) {
	var prev int32
	err := tx.QueryRow(ctx, "SELECT partitions FROM "+p.table.Quoted()+" WHERE topic = $1 FOR UPDATE", topic).Scan(&prev)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, p.explain(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+p.table.Quoted()+" (topic, partitions, recorded_by, previous) VALUES ($1, $2, 'partitions adopt', NULLIF($3, 0)) "+
		"ON CONFLICT (topic) DO UPDATE SET partitions = excluded.partitions, recorded_at = now(), recorded_by = excluded.recorded_by, previous = excluded.previous",
		topic, n, prev); err != nil {
		return 0, p.explain(err)
	}
	return prev, nil
}
