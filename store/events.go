package store

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
)

// EventColumns is the SELECT list that reads an event from the outbox
// table in layout l (layout.SelectList: the text forms the replication
// stream delivers, so a record built from an SQL read is byte for byte
// what the WAL path sends), each column qualified with alias when it is
// not empty, and NULL for each optional column the table lacks, as the WAL
// path takes a missing one. event.OfColumns reads its values; when
// payloadBinary, the payload column is a bytea, read in its text form as
// the stream sends it too, and each event read must say so
// (Event.PayloadBinary) for its record to carry the bytes.
func EventColumns(ctx context.Context, conn *pgx.Conn, outbox Table, l *layout.Layout, alias string) (list string, payloadBinary bool, err error) {
	exprs, payloadBinary, err := EventColumnExprs(ctx, conn, outbox, l, alias)
	return strings.Join(exprs, ", "), payloadBinary, err
}

// EventColumnExprs is EventColumns' list as its expressions, one per
// layout field, then one per header column.
func EventColumnExprs(ctx context.Context, conn *pgx.Conn, outbox Table, l *layout.Layout, alias string) (exprs []string, payloadBinary bool, err error) {
	// A domain over bytea is not taken as one: pgoutput names the
	// domain's type, so the WAL path could not tell, and the two paths
	// must build the same record.
	rows, err := conn.Query(ctx, `SELECT attname, atttypid = 'bytea'::regtype FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped`, outbox.Quoted())
	if err != nil {
		return nil, false, fmt.Errorf("read the outbox table's columns: %w", err)
	}
	present := map[string]bool{}
	for rows.Next() {
		var name string
		var bytea bool
		if err := rows.Scan(&name, &bytea); err != nil {
			rows.Close()
			return nil, false, fmt.Errorf("read the outbox table's columns: %w", err)
		}
		present[name] = true
		payloadBinary = payloadBinary || bytea && name == l.Column(layout.Payload)
	}
	if err := rows.Err(); err != nil {
		return nil, false, fmt.Errorf("read the outbox table's columns: %w", err)
	}
	if missing := l.MissingNamedColumns(func(c string) bool { return present[c] }); len(missing) > 0 {
		return nil, false, fmt.Errorf("%w: %w: outbox table %s: a flag names a column the table does not have: %s; fix the flag, or point --table at the right table (read as absent, the column's field would be missing from every record)",
			pg.ErrPrecondition, layout.ErrColumnMapping, outbox, strings.Join(missing, ", "))
	}
	quote := func(name string) string { return pgx.Identifier{name}.Sanitize() }
	if alias != "" {
		quote = func(name string) string { return pgx.Identifier{alias, name}.Sanitize() }
	}
	return l.SelectExprs(present, quote), payloadBinary, nil
}

// Failure is why an event is quarantined, as the quarantine table keeps
// it: the topic, the error's class, and the message (with its advice) for
// the operator.
type Failure struct {
	Topic, Class, Message string
}

// QuarantinedEvent describes an event that failed before it was sent.
func QuarantinedEvent(ev *event.Event, f Failure) Quarantined {
	return Quarantined{Stored: ev.Stored(), Topic: f.Topic, ErrorClass: f.Class, ErrorMessage: f.Message}
}

// QuarantinedRecord describes an event whose record Kafka rejected.
func QuarantinedRecord(r *event.Record, f Failure) Quarantined {
	return Quarantined{Stored: r.Stored(), Topic: f.Topic, ErrorClass: f.Class, ErrorMessage: f.Message}
}
