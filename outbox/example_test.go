package outbox_test

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/outbox"
)

// A service commits its business change and the event that announces it in
// one transaction: both exist, or neither does.
func ExampleWriter_Write() {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	w, err := outbox.New("public.outbox_events")
	if err != nil {
		panic(err)
	}

	tx, err := conn.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS example_orders (id text PRIMARY KEY, total_cents int, version bigint)`); err != nil {
		panic(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO example_orders VALUES ('order-42', 1999, 1)`); err != nil {
		panic(err)
	}
	ids, err := w.Write(ctx, tx, outbox.Event{
		// The caller's own ID, derived from the request, survives its retries.
		ID:               "0190f3a4-1c2b-7d3e-8f40-5a6b7c8d9e0f",
		AggregateType:    "order",
		AggregateID:      "order-42",
		EventType:        "OrderPlaced",
		Payload:          []byte(`{"total_cents": 1999}`),
		Headers:          map[string]string{"tenant": "acme"},
		AggregateVersion: 1,
	})
	if err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}
	fmt.Println(ids[0])

	var headers string
	if err := conn.QueryRow(ctx, `SELECT headers::text FROM outbox_events WHERE event_id = $1`, ids[0]).Scan(&headers); err != nil {
		panic(err)
	}
	fmt.Println(headers)
	// Output:
	// 0190f3a4-1c2b-7d3e-8f40-5a6b7c8d9e0f
	// {"tenant": "acme", "aggregate_version": "1"}
}

// A bad event fails in the service, before anything is written, with an
// error that names the event and the field.
func ExampleWriter_Write_refused() {
	w, err := outbox.New("")
	if err != nil {
		panic(err)
	}
	_, err = w.Write(context.Background(), nil, outbox.Event{
		ID: "0190f3a4-1c2b-7d3e-8f40-5a6b7c8d9e10", AggregateType: "order", AggregateID: "order-42",
		EventType: "OrderPlaced", Payload: []byte(`{}`), Headers: map[string]string{"event_type": "x"},
	})
	fmt.Println(err)
	// Output:
	// outbox event 1 of 1: event 0190f3a4-1c2b-7d3e-8f40-5a6b7c8d9e10: header "event_type" is set by the relay for every record and may not be a row header
}
