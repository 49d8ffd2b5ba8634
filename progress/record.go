// Package progress keeps, in Kafka, how far Kafka holds everything: for
// each slot of each PostgreSQL cluster, the end LSN of the last transaction
// whose events Kafka acknowledged along with every event before it. The
// record lives on a compacted topic and is written only after the acks it
// covers, so it may lag the truth but never lead it. PostgreSQL keeps a
// slot's confirmed position on disk only when it saves the slot (at a
// checkpoint, and not on every confirm), so after a server restart, crash
// or failover this record is what bounds re-delivery.
//
// The package owns the record's format, its key, creating the topic,
// reading the latest record for a key (read_committed, so records of
// aborted Kafka transactions never count) and a small writer that the
// relay feeds with confirmed positions.
package progress

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// DefaultTopic is the progress topic's name unless --progress-topic says
// otherwise.
const DefaultTopic = "outbox-relay.progress"

// Version is the record format this package writes and reads.
const Version = 1

// Record is one progress entry: every event of every transaction that
// ended at or before LSN, on Timeline, is in Kafka.
type Record struct {
	LSN      lsn.LSN
	Timeline uint32
	// CommitTime is the commit time of the transaction that ends at LSN;
	// zero when the position came from an idle confirmation before any
	// transaction of this run was confirmed.
	CommitTime   time.Time
	RelayVersion string
	// Delivery is the delivery mode of the relay that wrote the record
	// (at-least-once or exactly-once), for operators; empty in records of
	// relays that did not write it. Nothing decides on it.
	Delivery string
	// RecoverySince is set while the relay recovers a lost slot from the
	// outbox table: events committed after this time may be missing from
	// Kafka until the recovery finishes. A start that finds it set runs the
	// recovery again; the record written when it finishes has it zero.
	RecoverySince time.Time
}

// ErrBadRecord marks a stored record that cannot be used: it does not
// decode, or a newer relay wrote it (ErrUnknownVersion). Guessing would
// risk skipping events, so the operator decides (--reset-progress).
var ErrBadRecord = errors.New("unusable progress record")

// ErrUnknownVersion marks a record written in a format this relay does
// not know, by a newer relay.
var ErrUnknownVersion = errors.New("unknown progress record version")

// Key is the record's key: the slot name and the cluster's system
// identifier (IDENTIFY_SYSTEM), so a record of another cluster, or of a
// database restored from another cluster's backup under a new initdb, can
// never match.
func Key(slot string, systemID string) []byte {
	return []byte(slot + "@" + systemID)
}

// wireRecord is the record's JSON form, shared with the exactly-once mode.
type wireRecord struct {
	Version      int    `json:"version"`
	LSN          string `json:"lsn"`
	Timeline     uint32 `json:"timeline"`
	CommitTime   string `json:"commit_time,omitempty"`
	RelayVersion string `json:"relay_version"`
	Delivery     string `json:"delivery,omitempty"`
	// RecoverySince is omitted when zero, so the records of a relay that
	// never lost its slot read as before.
	RecoverySince string `json:"recovery_since,omitempty"`
}

// Marshal encodes the record as its JSON value, e.g.
// {"version":1,"lsn":"0/16B3748","timeline":1,"commit_time":"2026-12-01T03:00:00.123456Z","relay_version":"1.4.0"}.
func (r Record) Marshal() []byte {
	w := wireRecord{Version: Version, LSN: r.LSN.String(), Timeline: r.Timeline, RelayVersion: r.RelayVersion, Delivery: r.Delivery}
	if !r.CommitTime.IsZero() {
		w.CommitTime = r.CommitTime.UTC().Format(time.RFC3339Nano)
	}
	if !r.RecoverySince.IsZero() {
		w.RecoverySince = r.RecoverySince.UTC().Format(time.RFC3339Nano)
	}
	b, err := json.Marshal(w)
	if err != nil {
		panic(fmt.Sprintf("progress: marshal a record of strings and integers: %v", err)) // cannot happen
	}
	return b
}

// Unmarshal decodes a record's value. A record of another format version
// fails with ErrUnknownVersion rather than being half-understood.
func Unmarshal(b []byte) (Record, error) {
	var w wireRecord
	if err := json.Unmarshal(b, &w); err != nil {
		return Record{}, fmt.Errorf("decode progress record: %w", err)
	}
	if w.Version != Version {
		return Record{}, fmt.Errorf("%w %d (this relay reads version %d): a newer relay wrote it; run that version, or start once with --reset-progress to fall back to the slot's position",
			ErrUnknownVersion, w.Version, Version)
	}
	at, err := lsn.Parse(w.LSN)
	if err != nil {
		return Record{}, fmt.Errorf("decode progress record: %w", err)
	}
	if w.Timeline < 1 {
		return Record{}, fmt.Errorf("decode progress record: timeline %d: timelines start at 1", w.Timeline)
	}
	r := Record{LSN: at, Timeline: w.Timeline, RelayVersion: w.RelayVersion, Delivery: w.Delivery}
	if w.CommitTime != "" {
		if r.CommitTime, err = time.Parse(time.RFC3339Nano, w.CommitTime); err != nil {
			return Record{}, fmt.Errorf("decode progress record: commit_time: %w", err)
		}
	}
	if w.RecoverySince != "" {
		if r.RecoverySince, err = time.Parse(time.RFC3339Nano, w.RecoverySince); err != nil {
			return Record{}, fmt.Errorf("decode progress record: recovery_since: %w", err)
		}
	}
	return r, nil
}
