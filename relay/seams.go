package relay

import (
	"context"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
)

// walStream is where the WAL reader gets decoded replication messages and
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
	// SendStatus tells the server what was read and what may be released;
	// ping asks it to answer at once.
	SendStatus(written, flushed lsn.LSN, ping bool) error
	// Heard is when anything last arrived from the server.
	Heard() time.Time
	// Close ends the stream so that the last status sent is read.
	Close(ctx context.Context) error
}

// Sinks makes the relay's sinks and its progress store; publisher.Kafka
// is the real one. The relay knows nothing else of the system behind them.
type Sinks interface {
	// New makes an at-least-once sink whose batches are at most
	// batchLimit bytes (0: MaxMessageBytes).
	New(batchLimit int) (sink.Sink, error)
	// NewTransactional makes an exactly-once sink; making it fences older
	// ones with the same ID.
	NewTransactional(batchLimit int, t sink.Transactional) (sink.Sink, error)
	// ConnectWithin makes a sink with make for a one-shot command, giving
	// up once the sink's own timeout has passed or ctx ended.
	ConnectWithin(ctx context.Context, make func() (sink.Sink, error)) (sink.Sink, error)
	// MaxMessageBytes is the largest record, and batch, the sinks build.
	MaxMessageBytes() int
	// Brokers are where the sinks connect, for the operator.
	Brokers() []string
	// TopicTemplate is how events are routed to topics (--topic), and
	// CanName reports whether an event can be routed to topic.
	TopicTemplate() string
	CanName(topic string) (bool, error)
	// Check connects once: the relay asks before it makes a slot.
	Check() error
	// OpenProgress opens the progress store; create makes its topic when
	// missing.
	OpenProgress(ctx context.Context, topic string, create bool) (progress.Store, error)
	// ReadProgress reads key's record, creating nothing, within the sink's
	// own timeout.
	ReadProgress(ctx context.Context, topic string, key []byte) (rec progress.Record, found bool, err error)
}

// clock is the WAL reader's and the restart loop's time: the wall clock in
// production, a fake one in tests so status and restart timing are
// asserted exactly.
type clock = pipeline.Clock

// timer is the part of *time.Timer the loop uses.
type timer = pipeline.Timer
