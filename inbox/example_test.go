package inbox_test

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// A consumer applies each record in one transaction with its
// processed-event record; the second delivery of the same event is skipped.
func ExampleInbox_Handle() {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS example_balances (account text PRIMARY KEY, cents bigint)`); err != nil {
		panic(err)
	}

	metrics := inbox.NewMetrics("billing")
	prometheus.NewRegistry().MustRegister(metrics)
	ib, err := inbox.New(inbox.Config{Consumer: "billing", CheckVersions: true, Metrics: metrics})
	if err != nil {
		panic(err)
	}
	credit := func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
		_, err := tx.Exec(ctx, `INSERT INTO example_balances VALUES ($1, 100)
			ON CONFLICT (account) DO UPDATE SET cents = example_balances.cents + 100`, ev.AggregateID)
		return err
	}

	// The headers and value of a record, as any Kafka client hands them over.
	headers := []inbox.Header{
		{Key: []byte("event_id"), Value: []byte("0190f3a4-1c2b-7d3e-8f40-5a6b7c8d9e0f")},
		{Key: []byte("aggregate_type"), Value: []byte("account")},
		{Key: []byte("aggregate_id"), Value: []byte("acct-7")},
		{Key: []byte("event_type"), Value: []byte("Credited")},
		{Key: []byte("aggregate_version"), Value: []byte("1")},
	}
	for range 2 { // delivered twice, as at-least-once delivery may
		ev, err := inbox.Parse(headers, []byte(`{"cents": 100}`))
		if err != nil {
			panic(err)
		}
		res, err := ib.Handle(ctx, conn, ev, credit)
		if err != nil {
			panic(err) // not applied: do not commit the offset
		}
		fmt.Println(res.Outcome)
	}
	var cents int64
	if err := conn.QueryRow(ctx, `SELECT cents FROM example_balances WHERE account = 'acct-7'`).Scan(&cents); err != nil {
		panic(err)
	}
	fmt.Println(cents, metrics.Counts().Duplicates)
	// Output:
	// applied
	// duplicate
	// 100 1
}
