package replication

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// cluster is the PostgreSQL the package's tests share, started on first
// use; each test takes a database of its own.
var cluster harness.SharedPostgres

func TestMain(m *testing.M) { harness.Main(m) }

func testDatabase(t *testing.T) (*harness.PGDatabase, Config) {
	t.Helper()
	server := cluster.Get(t)
	db := server.CreateTestDatabase(t)
	cfg := Config{Config: pg.Config{DSN: db.DSN(), Table: "public.outbox_events"}, Publication: "outbox_relay", Slot: db.Name()}
	t.Cleanup(func() {
		server.Exec(t, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", cfg.Slot)
	})
	return db, cfg
}

func connect(t *testing.T, cfg Config) *Admin {
	t.Helper()
	admin, err := Connect(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(context.Background()) })
	return admin
}

// Issue 11.1: a slot dropped under a running relay was silently created
// again at the current position, and the events of the gap never reached
// Kafka. At first start the slot is created; once the process streamed, a
// missing slot is an error that names the slot and the way back.
func TestPrepareSlotCreatesOnlyAtFirstStart(t *testing.T) {
	_, cfg := testDatabase(t)
	admin := connect(t, cfg)
	ctx := context.Background()

	first, err := admin.PrepareSlot(ctx, SlotPolicy{})
	if err != nil {
		t.Fatalf("first start: %v", err)
	}
	if !first.Created || first.LSN == 0 {
		t.Fatalf("first start: %+v, want the slot created", first)
	}
	again, err := admin.PrepareSlot(ctx, SlotPolicy{MustExist: true})
	if err != nil || again.Created || again.LSN != first.LSN {
		t.Fatalf("existing slot: %+v, %v; want it reused at %v", again, err, first.LSN)
	}

	if err := admin.DropSlot(ctx); err != nil {
		t.Fatal(err)
	}
	lastCommit := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	_, err = admin.PrepareSlot(ctx, SlotPolicy{MustExist: true, LastConfirmedCommit: lastCommit})
	if !errors.Is(err, ErrSlotMissing) {
		t.Fatalf("missing slot after streaming: %v, want ErrSlotMissing", err)
	}
	for _, want := range []string{cfg.Slot, "--on-slot-lost recover", "--existing-rows pending", "2026-11-30T12:00:00Z"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
	if _, exists, err := admin.Slot(ctx); err != nil || exists {
		t.Fatalf("the slot was created anyway (exists %t, %v)", exists, err)
	}
}

// Issue 11.8: wrong column types were accepted without a word, and the
// relay published a bytea payload as the text \x00ff... A bytea payload is
// now published as its bytes, but a domain over bytea is refused: the
// stream names the domain, so its rows could not be told to carry bytes.
func TestCheckColumnsNamesWrongTypes(t *testing.T) {
	db, cfg := testDatabase(t)
	db.Exec(t, `CREATE TABLE outbox_events (event_id bigint PRIMARY KEY, aggregate_type text NOT NULL,
		aggregate_id int NOT NULL, event_type varchar(100) NOT NULL, payload uuid NOT NULL, occurred_at timestamptz)`)
	db.Exec(t, `CREATE PUBLICATION outbox_relay FOR TABLE outbox_events WITH (publish = 'insert')`)
	admin := connect(t, cfg)
	err := admin.Check(context.Background())
	if !errors.Is(err, pg.ErrPrecondition) {
		t.Fatalf("Check: %v, want a precondition error", err)
	}
	for _, want := range []string{
		"column event_id is bigint, want uuid or text",
		"column aggregate_id is integer, want text",
		"column payload is uuid, want jsonb or json or text or bytea",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
	if strings.Contains(err.Error(), "event_type") || strings.Contains(err.Error(), "occurred_at") {
		t.Errorf("the error blames a column of an accepted type: %v", err)
	}

	// Accepted types, through a domain too, pass.
	db.Exec(t, `CREATE DOMAIN event_key AS text`)
	db.Exec(t, `ALTER TABLE outbox_events ALTER COLUMN event_id TYPE event_key, ALTER COLUMN aggregate_id TYPE text,
		ALTER COLUMN payload TYPE text USING payload::text`)
	if err := admin.Check(context.Background()); err != nil {
		t.Fatalf("Check after fixing the types: %v", err)
	}
	db.Exec(t, `ALTER TABLE outbox_events ALTER COLUMN payload TYPE bytea USING convert_to(payload, 'UTF8')`)
	if err := admin.CheckColumns(context.Background()); err != nil {
		t.Fatalf("a bytea payload: %v", err)
	}
	db.Exec(t, `CREATE DOMAIN blob AS bytea`)
	db.Exec(t, `ALTER TABLE outbox_events ALTER COLUMN payload TYPE blob`)
	if err := admin.CheckColumns(context.Background()); err == nil || !strings.Contains(err.Error(), "column payload is a domain over bytea") {
		t.Fatalf("a domain over bytea: %v", err)
	}
	db.Exec(t, `ALTER TABLE outbox_events DROP COLUMN payload`)
	if err := admin.CheckColumns(context.Background()); err == nil || !strings.Contains(err.Error(), "column payload is missing") {
		t.Fatalf("a missing payload column: %v", err)
	}
}

// Issue 11.1: the warning on creating a slot reported every row of the
// table as "not published", misleading when an older slot had published
// them. ExistingRows gives the count with the newest row's creation time,
// and still counts a custom table without created_at.
func TestExistingRowsGivesTheNewestRow(t *testing.T) {
	db, cfg := testDatabase(t)
	db.Exec(t, `CREATE TABLE outbox_events (event_id uuid PRIMARY KEY, created_at timestamptz NOT NULL)`)
	db.Exec(t, `INSERT INTO outbox_events VALUES (gen_random_uuid(), '2026-01-01 10:00:00+00'), (gen_random_uuid(), '2026-02-01 10:00:00+00')`)
	admin := connect(t, cfg)
	rows, err := admin.ExistingRows(context.Background())
	want := time.Date(2026, 2, 1, 10, 0, 0, 0, time.UTC)
	if err != nil || rows.Count != 2 || !rows.NewestCreated.Equal(want) {
		t.Fatalf("ExistingRows: %+v, %v; want 2 rows, the newest created %v", rows, err, want)
	}
	db.Exec(t, `ALTER TABLE outbox_events DROP COLUMN created_at`)
	rows, err = admin.ExistingRows(context.Background())
	if err != nil || rows.Count != 2 || !rows.NewestCreated.IsZero() {
		t.Fatalf("ExistingRows without created_at: %+v, %v; want 2 rows and no time", rows, err)
	}
}

// The warnings say how long the relay may be down before a limit
// invalidates its slot, and say nothing when no limit is set.
func TestSlotLimitsWarnings(t *testing.T) {
	if w := (SlotLimits{CheckpointTimeout: 5 * time.Minute}).Warnings(); len(w) != 0 {
		t.Errorf("no limit set, yet warnings: %q", w)
	}
	w := SlotLimits{IdleTimeout: 10 * time.Minute, CheckpointTimeout: 5 * time.Minute, MaxWALKeepBytes: 2 << 30}.Warnings()
	if len(w) != 2 {
		t.Fatalf("want one warning per limit, got %q", w)
	}
	for i, want := range []string{"Keep every outage of the relay shorter than 10m0s", "only for as long as the server takes to write 2048 MB of WAL"} {
		if !strings.Contains(w[i], want) {
			t.Errorf("warning %d %q does not say %q", i, w[i], want)
		}
	}
}

// PostgreSQL 17+ names why it invalidated a slot; the relay's error gives
// that name and what it means, and still counts the slot as lost when
// wal_status does not say lost (an idle timeout keeps the WAL).
func TestSlotInvalidationNamesTheReason(t *testing.T) {
	str := func(s string) *string { return &s }
	restart := str("0/1000000")
	for _, c := range []struct {
		info SlotInfo
		want string
	}{
		{SlotInfo{Plugin: "pgoutput", RestartLSN: restart, WALStatus: str("reserved")}, ""},
		{SlotInfo{Plugin: "pgoutput", WALStatus: str("lost")}, "wal_status=lost: PostgreSQL removed WAL it still needed (max_slot_wal_keep_size)"},
		{SlotInfo{Plugin: "pgoutput", WALStatus: str("lost"), InvalidationReason: str("wal_removed")}, "invalidation_reason=wal_removed, wal_status=lost: PostgreSQL removed WAL"},
		{SlotInfo{Plugin: "pgoutput", RestartLSN: restart, InvalidationReason: str("idle_timeout")}, "invalidation_reason=idle_timeout: no relay streamed from it for longer than idle_replication_slot_timeout"},
		{SlotInfo{Plugin: "pgoutput", RestartLSN: restart, InvalidationReason: str("rows_removed")}, "invalidation_reason=rows_removed: catalog rows"},
	} {
		if got := c.info.Invalidation(); !strings.HasPrefix(got, c.want) || (c.want == "") != (got == "") {
			t.Errorf("%+v: Invalidation() = %q, want it to begin %q", c.info, got, c.want)
		}
		if c.info.Lost() != (c.want != "") {
			t.Errorf("%+v: Lost() = %v", c.info, c.info.Lost())
		}
	}
}
