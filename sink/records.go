package sink

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
)

// Sink turns events into records, sends them, and reports their outcomes.
// publisher's Publisher (at least once) and TxnSink (exactly once) send to
// Kafka; dryrun's prints and sends nothing.
//
// The contract the engine relies on (pinned for the Kafka sinks by the
// publisher's sink contract test):
//   - Build never blocks. While an event's topic is looked up it returns a
//     *TopicPendingError, and the engine calls Build again with the same
//     event once Done is closed.
//   - Input takes items in source order: records, the end of each source
//     transaction after all its records, and flushes. A send on it may
//     block; the engine selects on it with its other duties, and sends
//     nothing more after Close.
//   - Every record sent comes back exactly once on Outcomes, acknowledged
//     or failed, at any time after it was sent: right after, or later in
//     bulk. Outcomes of one transaction may arrive in any order.
//   - A sink that writes transactions (Transactional) closes them only at
//     source transaction ends, writes the end's progress record in the one
//     it closes there, reports acks only once it committed, and then
//     reports the transaction's end as an outcome of its own (KafkaTxn). A
//     flush makes it commit now, in the middle of a source transaction if
//     need be (the documented exception to whole transactions). One that
//     sends record by record ignores ends and flushes; the engine sends
//     them only to a transactional sink.
//   - Retries counts the sink's own retries since it was made.
//   - Close flushes for at most timeout; outcomes reported after it is
//     called may be dropped. Outcomes is closed once the sink ended.
type Sink interface {
	Build(ev *event.Event) (Record, error)
	Input() chan<- Item
	Outcomes() <-chan Outcome
	Retries() int64
	Close(timeout time.Duration) error
}

// Record is a built record, ready to send. Each sink has its own type; the
// engine reads only what it needs to account for it and to quarantine it.
type Record interface {
	// Topic is where the record goes.
	Topic() string
	// EventID is the event_id of the event the record was built from.
	EventID() string
	// Size is the record's encoded size in bytes, as the sink counts it.
	Size() int
	// Txn is the source transaction of the record's event, as the event
	// said: what its Delivery reports as Txn.
	Txn() uint64
	// Shaped is the record as the event's shape built it: what the
	// quarantine table keeps of a record the sink refused.
	Shaped() *event.Record
}

// Item is one thing the engine hands a sink, in source order: a record,
// the end of a source transaction, or a flush. Exactly one field is set.
// Records and ends travel on one channel so that a sink sees each end after
// every record of its transaction, by construction.
type Item struct {
	Record Record
	End    *SourceEnd
	// Flush asks a sink that holds acks until a transaction commits to
	// commit now, in the middle of a source transaction if need be (a
	// counted split). The engine sends it when its in-flight limits are
	// full: it waits for acks then, and only a commit makes them.
	Flush bool
}

// SourceEnd is the end of a source (PostgreSQL) transaction whose records
// were all sent: the only place an exactly-once sink may end a Kafka
// transaction, save for a split.
type SourceEnd struct {
	Txn        lsn.TxnID
	End        lsn.LSN // the commit's end LSN
	CommitTime time.Time
	// Progress is the record to write in the Kafka transaction that ends
	// here, built by the caller; nil writes none.
	Progress *ProgressRecord
}

// ProgressRecord is the record that says how far the sink holds the stream.
type ProgressRecord struct {
	Topic      string
	Key, Value []byte
	// Encode, when set, makes the value instead, on the sink's goroutine
	// as the Kafka transaction commits, for the last source transaction it
	// holds. Only that one is written: encoding the value at every source
	// transaction's end took a tenth of the relay's CPU catching up on
	// single-row transactions, and a third of its allocations.
	Encode func(end lsn.LSN, commitTime time.Time) []byte
}

// Delivery is what a sink reports of one record.
type Delivery struct {
	Txn        uint64
	CommitTime time.Time
	Bytes      int
	Topic      string
	// Partition and Offset are where the record was stored; -1 when it
	// never reached a partition (or the sink has none).
	Partition int32
	Offset    int64
	// At is when the sink reported the outcome, so latency is measured to
	// the ack and not to when the caller got round to reading it.
	At time.Time
	// Record is the record the outcome is of. A caller whose records are
	// not a WAL stream's (a poller's rows, a replay's list) finds which of
	// its own it was by it, where the engine goes by Txn.
	Record Record
}

// Outcome is one record's result, acknowledged when Err is nil; or, when
// KafkaTxn is set, the end of a transaction, reported by a transactional
// sink after the outcomes of its records.
type Outcome struct {
	Delivery
	Err      *Error
	KafkaTxn *TxnReport
}

// TxnReport says how a sink's transaction ended.
type TxnReport struct {
	Committed bool
	// End and CommitTime are those of the last whole source transaction a
	// committed transaction held, whose progress record it carried; zero
	// when it held only part of a split one.
	End        lsn.LSN
	CommitTime time.Time
	// Split says a source transaction too large for one transaction began
	// to be committed in parts here (reported once per source
	// transaction): read_committed consumers see its first part before
	// the rest.
	Split bool
}

// Error is the failure of one record, naming the event and where it went.
// Its message says what failed; Advice says what to do about it, and
// Explain puts the two together where an error reaches the operator.
type Error struct {
	Class     Class
	EventID   string
	Topic     string
	Partition int32 // -1 when the record never reached a partition
	Err       error
	// Record is the failed record, when it was built.
	Record Record
	// OrderMayBreak says re-delivering the record may put it after later
	// records of its partition: the sink may have appended those after
	// this one failed. The engine counts it.
	OrderMayBreak bool
}

func (e *Error) Error() string {
	where := "topic " + e.Topic
	if e.Partition >= 0 {
		where = fmt.Sprintf("topic %s partition %d", e.Topic, e.Partition)
	}
	return fmt.Sprintf("kafka %s error for event %s, %s: %v", e.Class, e.EventID, where, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }

// Advice tells the operator what to do about the error: the advice of the
// cause, when the sink gave one, else what the class calls for.
func (e *Error) Advice() string {
	var advised Advised
	if errors.As(e.Err, &advised) {
		if a := advised.Advice(); a != "" {
			return a
		}
	}
	if e.Class == ClassPermanent {
		return "fix the row or the topic, then `outbox-relay quarantine replay` it; the event is kept in the quarantine table (or, under --on-permanent-error halt, the relay stops on it), never dropped"
	}
	return "the relay re-streams from its confirmed position"
}

// TopicPendingError says Build cannot build the record yet: its topic is
// being looked up. Retry Build with the same event after Done is closed.
type TopicPendingError struct {
	Topic string
	Done  <-chan struct{}
}

func (e *TopicPendingError) Error() string {
	return "looking up topic " + e.Topic
}

// BuildWhenReady calls build (a sink's Build) until the event's topic is
// looked up or ctx ends: Build for callers without a loop of their own.
func BuildWhenReady(ctx context.Context, build func(*event.Event) (Record, error), ev *event.Event) (Record, error) {
	for {
		r, err := build(ev)
		var pending *TopicPendingError
		if !errors.As(err, &pending) {
			return r, err
		}
		select {
		case <-pending.Done:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}
