package store

import (
	"fmt"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/pg"
)

// DefaultQuarantineName is the quarantine table's name when
// --quarantine-table is not set; it lives in the outbox table's schema.
const DefaultQuarantineName = "outbox_quarantine"

// Table is a schema-qualified table name, unquoted.
type Table struct {
	Schema, Name string
}

// Quoted returns the name ready to put into SQL.
func (t Table) Quoted() string { return pgx.Identifier{t.Schema, t.Name}.Sanitize() }

// String returns schema.name as an operator writes it.
func (t Table) String() string { return t.Schema + "." + t.Name }

// ParseTable splits "schema.table" (schema defaults to public), and names
// flag in the error.
func ParseTable(flag, name string) (Table, error) {
	schema, table, err := pg.SplitTableFlag(flag, name)
	if err != nil {
		return Table{}, err
	}
	for _, part := range []string{schema, table} {
		if err := pg.ValidateIdentifier(flag, part); err != nil {
			return Table{}, err
		}
	}
	return Table{Schema: schema, Name: table}, nil
}

// QuarantineTable returns the quarantine table for an outbox table and the
// --quarantine-table setting: the setting when given, else
// outbox_quarantine in the outbox table's schema.
func QuarantineTable(outbox, configured string) (Table, error) {
	if configured != "" {
		return ParseTable("--quarantine-table", configured)
	}
	t, err := ParseTable("--table", outbox)
	if err != nil {
		return Table{}, err
	}
	return Table{Schema: t.Schema, Name: DefaultQuarantineName}, nil
}

// SlotRegistryName is the table, in the outbox table's schema, where the
// relay records each replication slot it made (migrations/009_slots.sql).
const SlotRegistryName = "outbox_relay_slots"

// SlotRegistry returns the table that records the slots made for an
// outbox table: outbox_relay_slots in its schema, shared by the schema's
// outbox tables, one row a slot.
func SlotRegistry(outbox Table) Table {
	return Table{Schema: outbox.Schema, Name: SlotRegistryName}
}

// pollSuffix names poll mode's state table after its outbox table.
const pollSuffix = "_poll"

// pollSnapshotSuffix names the snapshot strategy's progress table after
// its outbox table.
const pollSnapshotSuffix = "_poll_snapshot"

// SnapshotXidColumn is the column the snapshot strategy adds to the outbox
// table: each row's transaction id.
const SnapshotXidColumn = "outbox_relay_xid"

// StampTrigger names the outbox table's BEFORE INSERT trigger, and its
// function in the table's schema, that sets OrderColumn and
// SnapshotXidColumn on every row whatever the INSERT gave them (see
// migrations/008_outbox_stamp.sql).
func StampTrigger(outbox Table) string { return outbox.Name + "_outbox_relay_stamp" }

// OrderColumn numbers the outbox table's rows in insertion order, from a
// sequence. It is the only record of which of one transaction's rows came
// first once the table has been through WAL replay; the snapshot strategy
// and republishing read it.
const OrderColumn = "outbox_relay_seq"

// orderSequenceSuffix names the sequence behind OrderColumn after its
// outbox table.
const orderSequenceSuffix = "_outbox_relay_seq"

// OrderSequence returns the sequence that numbers an outbox table's rows:
// <table>_outbox_relay_seq in the same schema. A table name too long for
// that is cut, as PostgreSQL would cut it; two tables that then share the
// sequence still number their rows in insertion order.
func OrderSequence(outbox Table) Table {
	name := outbox.Name
	for len(name)+len(orderSequenceSuffix) > 63 {
		_, size := utf8.DecodeLastRuneInString(name)
		name = name[:len(name)-size]
	}
	return Table{Schema: outbox.Schema, Name: name + orderSequenceSuffix}
}

// PollSnapshotTable returns the snapshot strategy's progress table for an
// outbox table: <table>_poll_snapshot in the same schema, refused past
// PostgreSQL's 63-byte names as PollStateTable's is.
func PollSnapshotTable(outbox Table) (Table, error) {
	return besideOutbox(outbox, pollSnapshotSuffix, "poll mode's snapshot strategy keeps its progress")
}

// PollStateTable returns poll mode's state table for an outbox table:
// <table>_poll in the same schema.
func PollStateTable(outbox Table) (Table, error) {
	return besideOutbox(outbox, pollSuffix, "poll mode keeps its state")
}

// besideOutbox names a table of the relay's after its outbox table, in
// its schema. PostgreSQL would cut a name past 63 bytes and two outbox
// tables could then share one, so such a name is refused; what says what
// the table is for.
func besideOutbox(outbox Table, suffix, what string) (Table, error) {
	name := outbox.Name + suffix
	if len(name) > 63 {
		return Table{}, fmt.Errorf("--table %s: %s in %s, longer than PostgreSQL's 63-byte names: use an outbox table name of at most %d bytes",
			outbox, what, name, 63-len(suffix))
	}
	return Table{Schema: outbox.Schema, Name: name}, nil
}
