package relay

import (
	"context"
	"time"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
)

// walStream is where the read loop gets decoded replication messages and
// where it reports positions; *replication.Stream is the real one. (A
// source, in pipeline's sense, is the whole of what walSource runs.)
type walStream interface {
	// Receive waits until deadline for the next message; a Message of
	// KindNone means the deadline passed. The Message is reused by the
	// next call.
	Receive(deadline time.Time) (*replication.Message, error)
	// Buffered reports whether a Receive now would return at once, with
	// part of the next message already read from the socket.
	Buffered() bool
	// SendStatus tells the server what was read and what may be released.
	SendStatus(written, flushed lsn.LSN) error
	// Close ends the stream so that the last status sent is read.
	Close(ctx context.Context) error
}

// recordSink turns events into Kafka records, sends them, and reports their
// outcomes; *publisher.Publisher is the at-least-once one,
// *publisher.TxnSink the exactly-once one.
//
// The contract the read loop relies on (pinned for both by the publisher's
// sink contract test):
//   - Build never blocks. While an event's topic is looked up it returns a
//     *publisher.TopicPendingError, and the loop calls Build again with the
//     same event once Done is closed.
//   - Input takes items in WAL order: records, the end of each source
//     transaction after all its records, and flushes. A send on it may
//     block; the loop selects on it with its other duties, and sends
//     nothing more after Close.
//   - Every record sent comes back exactly once on Outcomes, acknowledged
//     or failed, at any time after it was sent: right after, or later in
//     bulk. Outcomes of one transaction may arrive in any order.
//   - A sink that writes Kafka transactions closes them only at source
//     transaction ends, writes the end's progress record in the one it
//     closes there, reports acks only once it committed, and then reports
//     the transaction's end as an outcome of its own (KafkaTxn). A flush
//     makes it commit now, in the middle of a source transaction if need
//     be (the documented exception to whole transactions). One that sends
//     record by record ignores ends and flushes; the loop sends them only
//     to a transactional sink.
//   - Retries counts the sink's own retries since it was made.
//   - Close flushes for at most timeout; outcomes reported after it is
//     called may be dropped. Outcomes is closed once the sink ended.
type recordSink interface {
	Build(ev *event.Event) (*publisher.Record, error)
	Input() chan<- publisher.Item
	Outcomes() <-chan publisher.Outcome
	Retries() int64
	Close(timeout time.Duration) error
}

// clock is the read loop's and the restart loop's time: the wall clock in
// production, a fake one in tests so status and restart timing are
// asserted exactly.
type clock = pipeline.Clock

// timer is the part of *time.Timer the loop uses.
type timer = pipeline.Timer
