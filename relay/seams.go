package relay

import (
	"context"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
)

// source is where the read loop gets decoded replication messages and
// where it reports positions; *replication.Stream is the real one.
type source interface {
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

// sink turns events into Kafka records, sends them, and reports their
// outcomes; *publisher.Publisher is the at-least-once one,
// *publisher.TxnSink the exactly-once one.
//
// The contract the read loop relies on:
//   - Build never blocks. While an event's topic is looked up it returns a
//     *publisher.TopicPendingError, and the loop calls Build again with the
//     same event once Done is closed.
//   - A send on Input may block; the loop selects on it with its other
//     duties, and sends nothing more after Close.
//   - Every record sent on Input comes back exactly once on Outcomes,
//     acknowledged or failed, at any time after it was sent: right after,
//     or later in bulk. Outcomes of one transaction may arrive in any order.
//   - EndTxn is called at each source transaction's commit, after every
//     record of it was sent. A sink that writes Kafka transactions closes
//     them only at these boundaries and reports acks only once its Kafka
//     transaction committed; one that sends record by record ignores it.
//   - Flush asks a sink that holds acks until a Kafka transaction commits
//     to commit now, without blocking. The loop calls it whenever its
//     in-flight limits are full: it is waiting for acks then, and a
//     transactional sink would otherwise wait for more records or its
//     interval. In the middle of a source transaction that splits it (the
//     documented exception to whole transactions). A record-by-record
//     sink ignores it.
//   - Retries counts the sink's own retries since it was made.
//   - Close flushes for at most timeout; outcomes reported after it is
//     called may be dropped.
type sink interface {
	Build(ev *publisher.Event) (*publisher.Record, error)
	Input() chan<- *publisher.Record
	Outcomes() <-chan publisher.Outcome
	EndTxn(txn lsn.TxnID, end lsn.LSN, commitTime time.Time)
	Flush()
	Retries() int64
	Close(timeout time.Duration) error
}

// clock is the read loop's time: the wall clock in production, a fake one
// in tests so status timing is asserted exactly.
type clock interface {
	Now() time.Time
	NewTimer(d time.Duration) timer
}

// timer is the part of *time.Timer the loop uses.
type timer interface {
	C() <-chan time.Time
	// Reset stops the timer, drops a tick not yet read, and starts it anew.
	Reset(d time.Duration)
	Stop()
}

// wallClock is the clock of the running relay.
type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }

func (wallClock) NewTimer(d time.Duration) timer { return wallTimer{time.NewTimer(d)} }

type wallTimer struct{ t *time.Timer }

func (w wallTimer) C() <-chan time.Time { return w.t.C }

// Since Go 1.23 Reset and Stop leave no stale tick in the channel.
func (w wallTimer) Reset(d time.Duration) { w.t.Reset(d) }
func (w wallTimer) Stop()                 { w.t.Stop() }
