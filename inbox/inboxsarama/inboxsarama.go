// Package inboxsarama runs an inbox.Inbox as a sarama consumer-group
// handler. It marks a record's offset only after the record's transaction
// committed (or after the inbox skipped it as a duplicate), so a crash at
// any moment re-delivers, and the inbox turns the re-delivery into a no-op.
package inboxsarama

import (
	"context"
	"errors"
	"time"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// Handler is a sarama.ConsumerGroupHandler that applies each record through
// an Inbox.
type Handler struct {
	Inbox *inbox.Inbox
	// DB begins each record's transaction (a *pgxpool.Pool, typically).
	DB      inbox.Beginner
	Handler inbox.Handler
	// CommitEach commits the offset synchronously after every record,
	// instead of leaving marked offsets to sarama's auto-commit: fewer
	// re-deliveries after a crash, one more round trip to Kafka per record.
	CommitEach bool
	// OnError, if set, is called for each failed attempt; the record is
	// retried with backoff (1 ms doubling to RetryMax) until it succeeds or
	// the session ends, so records of a partition are never applied out of
	// order. A record that can never succeed stops its partition: make the
	// handler park it somewhere and return nil if that is what you want.
	OnError func(msg *sarama.ConsumerMessage, err error)
	// RetryMax caps the backoff; default 5 s.
	RetryMax time.Duration
}

// Setup implements sarama.ConsumerGroupHandler.
func (h *Handler) Setup(sarama.ConsumerGroupSession) error { return nil }

// Cleanup implements sarama.ConsumerGroupHandler.
func (h *Handler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim implements sarama.ConsumerGroupHandler.
func (h *Handler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	ctx := sess.Context()
	for {
		select {
		case <-ctx.Done():
			return nil
		case msg, ok := <-claim.Messages():
			if !ok {
				return nil
			}
			if err := h.handle(ctx, msg); err != nil {
				// The session ended before the record was applied: it is
				// not marked, and its next owner gets it again.
				return nil
			}
			sess.MarkMessage(msg, "")
			if h.CommitEach {
				sess.Commit()
			}
		}
	}
}

// handle applies one record, retrying until it is applied or skipped, or
// ctx ends.
func (h *Handler) handle(ctx context.Context, msg *sarama.ConsumerMessage) error {
	headers := make([]inbox.Header, len(msg.Headers))
	for i, rh := range msg.Headers {
		headers[i] = inbox.Header{Key: rh.Key, Value: rh.Value}
	}
	wait := time.Millisecond
	maxWait := h.RetryMax
	if maxWait <= 0 {
		maxWait = 5 * time.Second
	}
	for {
		ev, err := inbox.Parse(headers, msg.Value)
		if err == nil {
			_, err = h.Inbox.Handle(ctx, h.DB, ev, h.Handler)
			if err == nil {
				return nil
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if h.OnError != nil {
			h.OnError(msg, err)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return errors.Join(ctx.Err(), err)
		case <-t.C:
		}
		wait = min(2*wait, maxWait)
	}
}
