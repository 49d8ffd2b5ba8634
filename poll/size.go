package poll

import (
	"errors"
	"fmt"
	"strings"

	"github.com/outbox-relay/outbox-relay/engine"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// Memory. A page (snapshot) or a batch (lease) is bounded by bytes as well
// as by --poll-batch rows: without it, a backlog of 1 MB rows held
// --poll-batch of them in each of the pages or batches in flight (1.78
// GB RSS for 1,000 such rows). Each gets a share of --max-in-flight-bytes,
// the WAL source's bound on what it holds, so that memory is bounded by the
// in-flight window there too: the snapshot strategy holds two pages (the
// one publishing and the one read ahead), the lease strategy three batches
// (one being marked, one publishing, one claimed and waiting), and the
// Kafka client copies the one it sends.
const (
	snapshotPagesHeld = 3
	leaseBatchesHeld  = 4
)

// sizedColumns are the outbox row's event columns as a bounded read
// selects them: size is the SQL of the row's size (its values' bytes, as
// the relay would receive them), computed by PostgreSQL without sending
// them, and guarded is the select list with every value but the event's
// identity (event id, aggregate type and id, event type) NULL where a
// condition holds: a row over --max-message-bytes is quarantined by
// reference, and its values are never read.
type sizedColumns struct {
	exprs []string
	size  string
}

func newSizedColumns(exprs []string) sizedColumns {
	terms := make([]string, len(exprs))
	for i, e := range exprs {
		terms[i] = "coalesce(octet_length(" + e + ")::bigint, 0)"
	}
	return sizedColumns{exprs: exprs, size: "(" + strings.Join(terms, " + ") + ")"}
}

// guarded is the select list, each large value NULL where cond holds.
func (c sizedColumns) guarded(cond string) string {
	out := make([]string, len(c.exprs))
	for i, e := range c.exprs {
		switch layout.Field(i) {
		case layout.EventID, layout.AggregateType, layout.AggregateID, layout.EventType:
			out[i] = e
		default:
			out[i] = "CASE WHEN " + cond + " THEN NULL::text ELSE " + e + " END"
		}
	}
	return strings.Join(out, ", ")
}

// errOversizeRow marks a row whose values are over --max-message-bytes.
var errOversizeRow = errors.New("row too large to read")

// oversize makes the engine event of a row whose values (size bytes) are
// over limit and were not read: refused, and quarantined by reference
// (its id, size and why), as the WAL path does with such a row. The row
// stays in the outbox table. held says what the strategy does with the
// rest of the aggregate meanwhile, for the operator.
func oversize(e *engine.Event, size int64, limit int, held string) {
	problem := fmt.Sprintf("the row's values (%d bytes) are over --max-message-bytes %d: the poller did not read them, to bound its memory; the row stays in the outbox table", size, limit)
	advice := "to publish it, raise the topic's max.message.bytes, --kafka-max-message-bytes and --max-message-bytes (the relay holds a few copies of each row up to it); " + held
	e.Refused = &sink.Error{Class: sink.ClassPermanent, EventID: string(e.EventID), Topic: "(not resolved)", Partition: -1,
		Err: sink.AdvisedError(fmt.Errorf("%w: %s", errOversizeRow, problem), advice)}
	e.Keep = func(q *store.Quarantined) {
		q.RawSize, q.ContentProblem = size, problem
	}
}

// pageBytes is the byte bound of one page or batch, of which held are
// in memory at once; at least one row is always taken.
func pageBytes(maxInFlight int64, held int) int64 {
	return max(maxInFlight/int64(held), 1)
}

// leaseOversizeHeld is what the lease strategy does with an oversize
// row's aggregate, and how to go on.
func leaseOversizeHeld(t tables) string {
	return fmt.Sprintf("the lease strategy holds the later events of its aggregate back meanwhile; once the limits are raised, `UPDATE %s SET quarantined_at = NULL WHERE event_id = ...` makes the poller claim and publish it again, and the aggregate goes on", t.state.Quoted())
}
