package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// WriterResult is one mode of the writer part: how fast a service can put
// events into the outbox with package outbox, and how many statements
// (each one round trip) that costs.
type WriterResult struct {
	Mode          string  `json:"mode"` // batch: one Write per transaction; single: one Write (INSERT) per event
	Events        int     `json:"events"`
	PerTxn        int     `json:"per_txn"`
	Seconds       float64 `json:"seconds"`
	EventsPerSec  float64 `json:"events_per_sec"`
	Statements    int64   `json:"statements"` // INSERTs sent, BEGIN and COMMIT not counted
	StatementsTxn float64 `json:"statements_per_txn"`
}

// writerBatch is the events per transaction of the writer part: a service
// writing a modest burst in one business transaction.
const writerBatch = 100

// writerPart measures the writer's batch path against one INSERT per event,
// in transactions of writerBatch events, alternating the two modes so both
// see the same machine.
func (b *bench) writerPart(ctx context.Context) ([]WriterResult, error) {
	const db = "bench_writer"
	dsn, err := b.createDB(ctx, db)
	if err != nil {
		return nil, err
	}
	defer b.dropDB(db)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	counter := &harness.StatementCounter{}
	cfg.Tracer = counter
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	w, err := outbox.New("")
	if err != nil {
		return nil, err
	}
	n := max(b.o.writerEvents/writerBatch, 1) * writerBatch
	payload := fmt.Appendf(nil, `{"pad": "%0*d"}`, max(b.o.payload-12, 1), 0)
	var out []WriterResult
	for rep := 0; rep < b.o.repeat; rep++ {
		modes := []string{"single", "batch"}
		if rep%2 == 1 {
			modes = []string{"batch", "single"}
		}
		for _, mode := range modes {
			res := WriterResult{Mode: mode, Events: n, PerTxn: writerBatch}
			start := time.Now()
			events := make([]outbox.Event, writerBatch)
			for done := 0; done < n; done += writerBatch {
				for i := range events {
					events[i] = outbox.Event{AggregateType: "order", AggregateID: fmt.Sprintf("agg-%d", (done+i)%b.o.aggregates),
						EventType: "order.updated", Payload: payload, Headers: map[string]string{"tenant": "acme"}}
				}
				statements, err := writeTxn(ctx, conn, w, events, mode == "batch", counter)
				if err != nil {
					return out, fmt.Errorf("writer, %s: %w", mode, err)
				}
				res.Statements += statements
			}
			res.Seconds = time.Since(start).Seconds()
			res.EventsPerSec = float64(n) / res.Seconds
			res.StatementsTxn = float64(res.Statements) / float64(n/writerBatch)
			b.logf("writer, %s: %d events in transactions of %d, %.0f events/s, %.1f INSERT statements per transaction",
				mode, n, writerBatch, res.EventsPerSec, res.StatementsTxn)
			out = append(out, res)
		}
	}
	return out, nil
}

// writeTxn writes events in one transaction: with one Write (batch), or
// one Write per event, which is one INSERT each. It returns the statements
// the writes sent, without BEGIN and COMMIT, which both modes pay alike.
func writeTxn(ctx context.Context, conn *pgx.Conn, w *outbox.Writer, events []outbox.Event, batch bool, counter *harness.StatementCounter) (int64, error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx)
	before := counter.Count()
	if batch {
		_, err = w.Write(ctx, tx, events...)
	} else {
		for i := range events {
			if _, err = w.Write(ctx, tx, events[i]); err != nil {
				break
			}
		}
	}
	if err != nil {
		return 0, err
	}
	statements := counter.Count() - before
	return statements, tx.Commit(ctx)
}

// writerMarkdown is the results section of the writer part.
func (r *Results) writerMarkdown(w func(string, ...any)) {
	if len(r.Writer) == 0 {
		return
	}
	w("\n## Writer: package outbox, batch against one INSERT per event\n\n")
	w("One connection writes events with `outbox.Writer.Write` in transactions of %d events: either one call per transaction (one multi-row INSERT) or one call per event (one INSERT, one round trip, each). Statements exclude BEGIN and COMMIT.\n\n", writerBatch)
	w("| mode | events | seconds | events/s | INSERT statements (round trips) per transaction |\n|---|---|---|---|---|\n")
	for _, x := range r.Writer {
		w("| %s | %d | %.2f | %.0f | %.1f |\n", x.Mode, x.Events, x.Seconds, x.EventsPerSec, x.StatementsTxn)
	}
}
