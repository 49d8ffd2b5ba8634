package relay

import (
	"context"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
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

// clock is the read loop's and the restart loop's time: the wall clock in
// production, a fake one in tests so status and restart timing are
// asserted exactly.
type clock = pipeline.Clock

// timer is the part of *time.Timer the loop uses.
type timer = pipeline.Timer
