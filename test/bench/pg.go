package main

import (
	"context"
	"fmt"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/poll"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// publication is the relay's default publication name, created by the
// migrations in each benchmark database.
const publication = "outbox_relay"

// fillProcedure commits n outbox rows in transactions of perTxn rows, from
// inside the server: PostgreSQL 11+ procedures may COMMIT in a loop. Rows
// spread over `aggregates` aggregate IDs; the payload is a jsonb object of
// about the requested size.
const fillProcedure = `
CREATE OR REPLACE PROCEDURE bench_fill(first bigint, n bigint, per_txn int, aggregates int, pad int)
LANGUAGE plpgsql AS $$
DECLARE
	i bigint := first;
BEGIN
	WHILE i < first + n LOOP
		INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
		SELECT gen_random_uuid(), 'order', 'agg-' || (g % aggregates), 'order.updated',
		       jsonb_build_object('seq', g, 'customer', 'cust-' || (g % 977), 'amount', (g % 100000) / 100.0,
		                          'currency', 'EUR', 'pad', repeat('x', pad))
		FROM generate_series(i, least(i + per_txn, first + n) - 1) AS g;
		COMMIT;
		i := i + per_txn;
	END LOOP;
END
$$`

// fillMessagesProcedure is bench_fill for the messages source: the same
// events, emitted as transactional logical decoding messages whose content
// PostgreSQL builds as the writer library's Emit does.
const fillMessagesProcedure = `
CREATE OR REPLACE PROCEDURE bench_fill_messages(first bigint, n bigint, per_txn int, aggregates int, pad int)
LANGUAGE plpgsql AS $$
DECLARE
	i bigint := first;
BEGIN
	WHILE i < first + n LOOP
		PERFORM pg_logical_emit_message(true, 'outbox', jsonb_build_object(
		           'event_id', gen_random_uuid(), 'aggregate_type', 'order', 'aggregate_id', 'agg-' || (g % aggregates),
		           'event_type', 'order.updated', 'schema_version', 1, 'occurred_at', now(),
		           'payload', jsonb_build_object('seq', g, 'customer', 'cust-' || (g % 977), 'amount', (g % 100000) / 100.0,
		                                         'currency', 'EUR', 'pad', repeat('x', pad)))::text)
		FROM generate_series(i, least(i + per_txn, first + n) - 1) AS g;
		COMMIT;
		i := i + per_txn;
	END LOOP;
END
$$`

// createDB creates a database with the outbox schema and the fill
// procedure, and returns its DSN.
func (b *bench) createDB(ctx context.Context, name string) (string, error) {
	return createDatabase(ctx, b.pg, name, "")
}

// createDatabase creates database name on pg with the outbox schema (and
// what poll mode's strategy pollStrategy needs, if set) and the fill
// procedure, and returns its DSN.
func createDatabase(ctx context.Context, pg *harness.Postgres, name string, pollStrategy string) (string, error) {
	admin, err := pgx.Connect(ctx, pg.DSN("postgres"))
	if err != nil {
		return "", err
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return "", fmt.Errorf("drop database %s: %w", name, err)
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	dsn := pg.DSN(name)
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.Background())
	names := migrations.Names{Schema: "public", Table: "outbox_events", Publication: publication,
		Poll: pollStrategy == poll.StrategyLease, PollSnapshot: pollStrategy == poll.StrategySnapshot}
	if _, err := migrations.Apply(ctx, conn, names); err != nil {
		return "", err
	}
	for _, proc := range []string{fillProcedure, fillMessagesProcedure} {
		if _, err := conn.Exec(ctx, proc); err != nil {
			return "", fmt.Errorf("create fill procedure: %w", err)
		}
	}
	return dsn, nil
}

// dropDB drops a database and the slots in it, freeing their WAL.
func (b *bench) dropDB(name string) { dropDatabase(b.pg, name) }

// dropDatabase drops database name on pg and the slots in it.
func dropDatabase(pg *harness.Postgres, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, err := pgx.Connect(ctx, pg.DSN("postgres"))
	if err != nil {
		return
	}
	defer admin.Close(context.Background())
	admin.Exec(ctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active", name)
	admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
}

// createSlots creates pgoutput slots back to back on one connection, with
// nothing written in between, so every slot holds the same WAL.
func createSlots(ctx context.Context, dsn string, names []string) (lsn.LSN, error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var first lsn.LSN
	for i, name := range names {
		var at string
		if err := conn.QueryRow(ctx, "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')", name).Scan(&at); err != nil {
			return 0, fmt.Errorf("create slot %s: %w", name, err)
		}
		if i == 0 {
			if first, err = lsn.Parse(at); err != nil {
				return 0, err
			}
		}
	}
	return first, nil
}

// padFor returns the pad length that makes the fill procedure's payload
// about size bytes of jsonb text.
func padFor(ctx context.Context, dsn string, size int) (int, error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var base int
	err = conn.QueryRow(ctx, `SELECT octet_length(jsonb_build_object('seq', 500000, 'customer', 'cust-500', 'amount', 500.00,
		'currency', 'EUR', 'pad', '')::text)`).Scan(&base)
	if err != nil {
		return 0, err
	}
	return max(size-base, 0), nil
}

// fill commits rows outbox rows in transactions of perTxn rows using conns
// connections at once (synchronous_commit off), then commits the last
// transaction alone and returns the WAL position just past its commit: the
// end position of the backlog. A non-transactional logical message written
// right after it makes the walsender move past that position, so
// pg_recvlogical's --endpos and the relay's idle confirmation both see it.
func fill(ctx context.Context, dsn string, rows, perTxn, conns, aggregates, pad int) (end lsn.LSN, err error) {
	return fillWith(ctx, dsn, "bench_fill", rows, perTxn, conns, aggregates, pad)
}

// fillWith is fill with the procedure proc: bench_fill, or
// bench_fill_messages for the messages source.
func fillWith(ctx context.Context, dsn, proc string, rows, perTxn, conns, aggregates, pad int) (end lsn.LSN, err error) {
	last := perTxn
	if last > rows {
		last = rows
	}
	bulk := rows - last
	chunk := ((bulk+conns-1)/conns + perTxn - 1) / perTxn * perTxn
	var wg sync.WaitGroup
	errs := make([]error, conns)
	for w := 0; w < conns; w++ {
		first := w * chunk
		n := min(chunk, bulk-first)
		if n <= 0 {
			continue
		}
		wg.Add(1)
		go func(w, first, n int) {
			defer wg.Done()
			errs[w] = callProc(ctx, dsn, proc, first, n, perTxn, aggregates, pad, false)
		}(w, first, n)
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return 0, err
		}
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, fmt.Sprintf("CALL %s(%d, %d, %d, %d, %d)", proc, bulk, last, perTxn, aggregates, pad)); err != nil {
		return 0, fmt.Errorf("fill last transaction: %w", err)
	}
	var at string
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&at); err != nil {
		return 0, err
	}
	if err := nudgeWAL(ctx, conn); err != nil {
		return 0, err
	}
	return lsn.Parse(at)
}

// nudgeWAL writes a WAL record no publication carries. A walsender that
// reads it has moved past everything before it, and tells its client.
func nudgeWAL(ctx context.Context, conn *pgx.Conn) error {
	if _, err := conn.Exec(ctx, "SELECT pg_logical_emit_message(false, 'outbox-relay-bench', 'end')"); err != nil {
		return fmt.Errorf("write end marker: %w", err)
	}
	return nil
}

func callProc(ctx context.Context, dsn, proc string, first, n, perTxn, aggregates, pad int, syncCommit bool) error {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if !syncCommit {
		if _, err := conn.Exec(ctx, "SET synchronous_commit = off"); err != nil {
			return err
		}
	}
	if _, err := conn.Exec(ctx, fmt.Sprintf("CALL %s(%d, %d, %d, %d, %d)", proc, first, n, perTxn, aggregates, pad)); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	return nil
}

// slotState is a slot's confirmed position and active walsender.
type slotState struct {
	confirmed lsn.LSN
	activePID int
}

func readSlot(ctx context.Context, conn *pgx.Conn, slot string) (slotState, error) {
	var confirmed *string
	var pid *int32
	err := conn.QueryRow(ctx, "SELECT confirmed_flush_lsn::text, active_pid FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&confirmed, &pid)
	if err != nil {
		return slotState{}, fmt.Errorf("read slot %s: %w", slot, err)
	}
	var s slotState
	if confirmed != nil {
		if s.confirmed, err = lsn.Parse(*confirmed); err != nil {
			return s, err
		}
	}
	if pid != nil {
		s.activePID = int(*pid)
	}
	return s, nil
}

// libpqDSN turns the harness's URL into the key=value form pg_recvlogical's
// -d takes as a connection string.
func libpqDSN(dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		return dsn
	}
	port, _ := strconv.Atoi(u.Port())
	return fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", u.Hostname(), port, u.User.Username(), u.Path[1:])
}

// payloadBytes reports the average payload size the backlog really has.
func payloadBytes(ctx context.Context, dsn string) (float64, error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var avg float64
	err = conn.QueryRow(ctx, "SELECT coalesce(avg(octet_length(payload::text)), 0)::float8 FROM (SELECT payload FROM outbox_events LIMIT 1000) s").Scan(&avg)
	return avg, err
}
