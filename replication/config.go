// Package replication reads the outbox table's committed inserts from
// PostgreSQL's write-ahead log. It checks the server's preconditions, owns the
// pgoutput logical replication slot and the replication connection, decodes
// pgoutput messages into transactions and rows, and sends the standby status
// updates that tell the server what the relay has confirmed. It knows nothing
// of Kafka.
package replication

import (
	"github.com/outbox-relay/outbox-relay/pg"
)

// Config names the database objects the relay reads from: the database
// and outbox table every source shares, and the publication and slot only
// streaming uses.
type Config struct {
	pg.Config
	Publication string
	Slot        string
	// SlotFailover creates the slot as a failover slot (PostgreSQL 17+).
	SlotFailover bool
	// Source is what the slot's changes are read as; nil is the outbox
	// table's inserts (TableSource). With a MessageSource, Table is not
	// read.
	Source Source
	// MaxMessageBytes bounds the change (a message's content, an outbox
	// row) the relay reads into memory; a larger message's content, or a
	// larger row's large values, are dropped from the connection as they
	// stream by and the event quarantined by reference (its WAL position,
	// size and SHA-256). Zero reads every change whole.
	MaxMessageBytes int
}

// DefaultMaxMessageBytes is MaxMessageBytes' default: far above what a
// Kafka record holds by default (1 MB), and a few copies of it stay well
// inside the shipped unit's memory limit (1 GiB).
const DefaultMaxMessageBytes = 64 << 20

// Validate checks the names before any connection is made.
func (c Config) Validate() error {
	if err := c.Config.Validate(); err != nil {
		return err
	}
	return c.ValidateNames()
}

// ValidateNames checks the table, slot and publication names alone, for
// paths that need no connection, such as printing the migration SQL.
func (c Config) ValidateNames() error {
	if _, _, err := pg.SplitTable(c.Table); err != nil {
		return err
	}
	if err := pg.ValidateSlotName(c.Slot); err != nil {
		return err
	}
	return pg.ValidateIdentifier("--publication", c.Publication)
}

// source is the configured Source, the table's by default.
func (c Config) source() Source {
	if c.Source == nil {
		return TableSource{}
	}
	return c.Source
}

// ReadsTable reports whether the events are rows of the outbox table.
func (c Config) ReadsTable() bool { return c.source().ReadsTable() }

// GapAdvice says how to get the events committed while no slot held them
// (from since on) into Kafka, for the configured source.
func (c Config) GapAdvice(since string) string { return c.source().GapAdvice(since) }
