package poll

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// The claim's generic plan reads the pending rows in order and stops at its
// batch, and a mark finds its rows by the primary key, even when the
// statistics were taken while nothing was pending and a backlog came
// after: the usual state of an outbox, then an outage. With
// sorts allowed the planner picks a plan that reads and sorts the whole
// backlog for each claim (measured: 1.7 s per 500 rows at 300,000
// pending, against 14 ms).
func TestClaimPlanReadsPendingRowsInOrderWhateverTheStatistics(t *testing.T) {
	ctx := context.Background()
	db, conn, cfg, tabs := migratedOutbox(t, StrategyLease)
	db.Exec(t, "ALTER TABLE outbox_events_poll SET (autovacuum_enabled = false)")
	insert := `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
		SELECT gen_random_uuid(), 'order', (g % 1000)::text, 'created', '{}' FROM generate_series(1, 50000) g`
	db.Exec(t, insert)
	db.Exec(t, "UPDATE outbox_events_poll SET published_at = now()")
	db.Exec(t, "VACUUM ANALYZE outbox_events_poll") // all published, none pending
	db.Exec(t, insert)

	for _, settings := range []string{plannerSettings, claimPlannerSettings} {
		if _, err := conn.Exec(ctx, settings); err != nil {
			t.Fatal(err)
		}
	}
	q, err := newQueries(ctx, conn, tabs, cfg.Postgres.OutboxLayout(), "w", true)
	if err != nil {
		t.Fatal(err)
	}
	plan, text := explain(t, conn, "claim(int, text, bigint, bool, bigint, int)", q.claim, "claim(500, 'w', 60000, true, 16777216, 67108864)")
	picked := plan.find(func(n *planNode) bool { return n.SubplanName == "CTE picked" })
	if picked == nil {
		t.Fatalf("no CTE picked in the claim's plan:\n%s", text)
	}
	if sort := picked.find(func(n *planNode) bool { return n.NodeType == "Sort" }); sort != nil {
		t.Errorf("the claim sorts the pending rows instead of reading them in order from the pending rows' index: it reads the whole backlog for every claim\n%s", text)
	}
	if agg := picked.find(func(n *planNode) bool { return n.NodeType == "Aggregate" }); agg != nil {
		t.Errorf("the claim counts the pending rows to find the oldest, instead of reading the first of the pending rows' index\n%s", text)
	}
	if scan := picked.find(func(n *planNode) bool { return n.IndexName == "outbox_events_poll_pending_idx" && n.Alias == "s" }); scan == nil {
		t.Errorf("the claim does not read the pending rows' index:\n%s", text)
	}

	// Marks run on a connection with the poller's planner settings, but
	// not the claim's.
	marks := db.Connect(t)
	if _, err := marks.Exec(ctx, plannerSettings); err != nil {
		t.Fatal(err)
	}
	plan, text = explain(t, marks, "mark(bigint[])", q.markPublishedSQL(), "mark('{1,2,3}')")
	if scan := plan.find(func(n *planNode) bool { return n.Alias == "outbox_events_poll" && n.NodeType != "ModifyTable" }); scan == nil || scan.IndexName != "outbox_events_poll_pkey" {
		t.Errorf("marking rows published does not find them by the primary key:\n%s", text)
	}
}

// migratedOutbox starts a server of the test's own and migrates a
// database on it for poll mode's strategy, returning the database, a
// connection, the poller's configuration and its tables.
func migratedOutbox(t *testing.T, strategy string) (*harness.PGDatabase, *pgx.Conn, Config, tables) {
	t.Helper()
	db := harness.StartPostgres(t, harness.PGOptions{}).CreateTestDatabase(t)
	conn := db.Connect(t)
	names := migrations.Names{Schema: "public", Table: "outbox_events", Publication: "outbox_relay",
		Poll: strategy == StrategyLease, PollSnapshot: strategy == StrategySnapshot}
	if _, err := migrations.Apply(context.Background(), conn, names); err != nil {
		t.Fatal(err)
	}
	cfg := Config{Postgres: pg.Config{DSN: db.DSN(), Table: "public.outbox_events"}, Strategy: strategy}
	tabs, err := cfg.tables()
	if err != nil {
		t.Fatal(err)
	}
	return db, conn, cfg, tabs
}

// explain prepares sql as name and returns the generic plan of execute.
func explain(t *testing.T, conn *pgx.Conn, name, sql, execute string) (*planNode, string) {
	t.Helper()
	ctx := context.Background()
	if _, err := conn.Exec(ctx, "PREPARE "+name+" AS "+sql); err != nil {
		t.Fatal(err)
	}
	var plan []struct{ Plan planNode }
	var text string
	if err := conn.QueryRow(ctx, "EXPLAIN (FORMAT JSON) EXECUTE "+execute).Scan(&text); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(text), &plan); err != nil || len(plan) != 1 {
		t.Fatalf("read the plan: %v\n%s", err, text)
	}
	return &plan[0].Plan, text
}

// planNode is a node of EXPLAIN (FORMAT JSON).
type planNode struct {
	NodeType    string     `json:"Node Type"`
	SubplanName string     `json:"Subplan Name"`
	IndexName   string     `json:"Index Name"`
	Alias       string     `json:"Alias"`
	Plans       []planNode `json:"Plans"`
	// Set by EXPLAIN ANALYZE.
	RelationName string  `json:"Relation Name"`
	ActualRows   float64 `json:"Actual Rows"`
	ActualLoops  float64 `json:"Actual Loops"`
	// RowsRemoved are the rows a scan read and its filter dropped.
	RowsRemoved float64 `json:"Rows Removed by Filter"`
}

// find returns the first node, n or below it, that match holds for.
func (n *planNode) find(match func(*planNode) bool) *planNode {
	if match(n) {
		return n
	}
	for i := range n.Plans {
		if found := n.Plans[i].find(match); found != nil {
			return found
		}
	}
	return nil
}
