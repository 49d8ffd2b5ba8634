// Package inboxkgo applies records fetched by a franz-go consumer
// (github.com/twmb/franz-go/pkg/kgo) through an inbox.Inbox. Like
// inboxsarama, it applies each partition's records of a fetch in batches
// (inbox.HandleBatch) and marks a record for commit only after its batch
// committed (or the inbox skipped it), so a crash at any moment
// re-delivers, and the inbox turns the re-delivery into a no-op.
//
// The client must be a group consumer that commits marked offsets only:
// kgo.ConsumerGroup and kgo.AutoCommitMarks (or kgo.DisableAutoCommit with
// Consumer.CommitEach). kgo.BlockRebalanceOnPoll is recommended: a
// rebalance then waits until the records of a poll are applied, instead of
// handing them to another member that applies them too (the inbox skips
// them there, but the work is done twice).
package inboxkgo

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// Consumer polls a kgo client and applies its records through an Inbox.
type Consumer struct {
	Client *kgo.Client
	Inbox  *inbox.Inbox
	// DB begins each batch's transaction (a *pgxpool.Pool, typically).
	DB      inbox.Beginner
	Handler inbox.Handler
	// CommitEach commits the marked offsets synchronously after every
	// poll's records are applied, instead of leaving them to the client's
	// auto-commit: fewer re-deliveries after a crash, one more round trip
	// to Kafka per poll.
	CommitEach bool
	// OnError, if set, is called for each failed attempt, with the record
	// that failed; the records before it in its partition are applied and
	// marked, and it is retried with backoff (1 ms doubling to RetryMax)
	// until it succeeds or ctx ends, so records of a partition are never
	// applied out of order. The next poll waits for every partition of this
	// one, so a record that can never succeed stops the consumer: make the
	// handler park it somewhere and return nil if that is what you want.
	OnError func(rec *kgo.Record, err error)
	// RetryMax caps the backoff; default 5 s.
	RetryMax time.Duration
}

// Run polls and applies records until ctx ends or the client is closed. It
// returns nil when ctx ends, and the error of a fetch that is not
// retriable otherwise.
func (c *Consumer) Run(ctx context.Context) error {
	if c.Client == nil || c.Inbox == nil || c.DB == nil || c.Handler == nil {
		return errors.New("inboxkgo: Client, Inbox, DB and Handler must all be set")
	}
	// With kgo.BlockRebalanceOnPoll, closing the client waits until the
	// last poll's records are released.
	defer c.Client.AllowRebalance()
	for {
		fetches := c.Client.PollFetches(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if fetches.IsClientClosed() {
			return nil
		}
		var fatal error
		fetches.EachError(func(topic string, partition int32, err error) {
			// The client retries what it can retry by itself; what it
			// returns here is for the caller (an authorization failure,
			// a topic that does not exist).
			if fatal == nil && !errors.Is(err, context.Canceled) {
				fatal = fmt.Errorf("fetch %s partition %d: %w", topic, partition, err)
			}
		})
		if fatal != nil {
			return fatal
		}
		var wg sync.WaitGroup
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) > 0 {
				wg.Go(func() { c.apply(ctx, p.Records) })
			}
		})
		wg.Wait()
		if ctx.Err() != nil {
			return nil
		}
		if c.CommitEach {
			if err := c.Client.CommitMarkedOffsets(ctx); err != nil && ctx.Err() == nil {
				return fmt.Errorf("commit offsets: %w", err)
			}
		}
		c.Client.AllowRebalance()
	}
}

// apply applies one partition's records in order, marking each once its
// batch committed.
func (c *Consumer) apply(ctx context.Context, recs []*kgo.Record) {
	_ = c.Inbox.ApplyInOrder(ctx, c.DB, inbox.Records{
		Len: len(recs),
		Parse: func(i int) (inbox.Event, error) {
			return inbox.ParseRecord(recs[i].Key, headers(recs[i]), recs[i].Value)
		},
		Applied: func(from, to int) { c.Client.MarkCommitRecords(recs[from:to]...) },
		Failed: func(i int, err error) {
			if c.OnError != nil {
				c.OnError(recs[i], err)
			}
		},
	}, c.Handler, c.RetryMax)
}

func headers(rec *kgo.Record) []inbox.Header {
	hs := make([]inbox.Header, len(rec.Headers))
	for i, rh := range rec.Headers {
		hs[i] = inbox.Header{Key: []byte(rh.Key), Value: rh.Value}
	}
	return hs
}
