package replication

import (
	"context"
	"fmt"

	"github.com/outbox-relay/outbox-relay/pg"
)

// Source is what a slot's changes are read as, chosen once from --source:
// an outbox table's inserts (TableSource, the default) or transactional
// logical decoding messages (MessageSource). Everything that differs
// between them in reading a slot is here, so no code compares settings to
// tell them apart.
type Source interface {
	// newDecoder makes the stream's decoder.
	newDecoder(cfg Config) (*decoder, error)
	// pluginArgs are pgoutput's options beside the publication.
	pluginArgs() []string
	// check verifies the server serves the source: its publication and,
	// for the table, the table and its columns.
	check(ctx context.Context, a *Admin) error
	// GapAdvice says how to get the events committed while no slot held
	// them (from since on) into Kafka.
	GapAdvice(since string) string
	// Migrate is the command that makes the source's slot again.
	Migrate() string
	// ReadsTable reports whether the events are rows of an outbox table,
	// which pollers, retention and reconcile also work on.
	ReadsTable() bool
}

// TableSource reads the outbox table's inserts.
type TableSource struct{}

func (TableSource) newDecoder(cfg Config) (*decoder, error) {
	schema, table, err := pg.SplitTable(cfg.Table)
	if err != nil {
		return nil, err
	}
	return newDecoder(schema, table, cfg.OutboxLayout()), nil
}

func (TableSource) pluginArgs() []string { return nil }

func (TableSource) check(ctx context.Context, a *Admin) error { return a.checkTable(ctx) }

// GapAdvice sends the operator to reconcile, which finds the gap's events
// in the table and republishes what Kafka lacks.
func (TableSource) GapAdvice(since string) string {
	return fmt.Sprintf("run `outbox-relay reconcile --since %s --republish` to find the events of the gap and publish them; a relay started with --on-slot-lost recover does that by itself whenever its slot is lost", since)
}

func (TableSource) Migrate() string  { return "outbox-relay migrate" }
func (TableSource) ReadsTable() bool { return true }

// MessageSource reads the transactional logical decoding messages whose
// prefix is Prefix.
type MessageSource struct{ Prefix string }

func (m MessageSource) newDecoder(Config) (*decoder, error) { return newMessageDecoder(m.Prefix), nil }

// pluginArgs asks for messages, which protocol version 1 carries on
// PostgreSQL 14 and later.
func (MessageSource) pluginArgs() []string { return []string{"messages 'true'"} }

func (MessageSource) check(ctx context.Context, a *Admin) error {
	return a.checkMessagesPublication(ctx)
}

// GapAdvice says that a message exists only in the WAL: no table holds the
// gap's events, so only their writers can emit them again.
func (MessageSource) GapAdvice(since string) string {
	return fmt.Sprintf("the events of that gap (committed since %s) were logical decoding messages, which exist only in the WAL: no table holds them, and reconcile cannot find them. "+
		"To deliver them, the services that emitted them must emit them again from their own records, or restore a backup taken before the gap and have them re-emitted from it; consumers dedupe a re-emitted event by its event_id. "+
		"No relay setting does this for you: --on-slot-lost recover republishes from the rows of a table, and this source writes none", since)
}

func (MessageSource) Migrate() string  { return "outbox-relay migrate --source messages" }
func (MessageSource) ReadsTable() bool { return false }
