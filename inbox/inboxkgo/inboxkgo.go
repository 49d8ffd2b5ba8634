// Package inboxkgo applies records fetched by a franz-go consumer
// (github.com/twmb/franz-go/pkg/kgo) through an inbox.Inbox. Like
// inboxsarama, it applies each partition's records of a fetch in batches
// (inbox.HandleBatch) and marks a record for commit only after its batch
// committed (or the inbox skipped it), so a crash at any moment
// re-delivers, and the inbox turns the re-delivery into a no-op.
//
// Each partition's records are applied by a goroutine of their own, and
// the partition is paused (kgo's PauseFetchPartitions) until they are, so
// a partition whose record keeps failing waits alone while the member's
// other partitions keep being polled and applied.
//
// The client must be a group consumer that commits marked offsets only:
// kgo.ConsumerGroup and kgo.AutoCommitMarks (or kgo.DisableAutoCommit with
// Consumer.CommitEach). kgo.BlockRebalanceOnPoll is recommended: a
// rebalance then waits until the records of a poll are handed to their
// partitions' goroutines, so none is revoked between the poll and the
// pause. A rebalance does not wait for a batch that is still being
// applied: the batch goes on, its partition's next owner may get the same
// records, and the inbox applies each event once (the second transaction
// waits on the first's record, then skips the event). kgo ignores a mark
// for a partition it no longer consumes, and a mark never covers a record
// that is not applied, so a late mark is never a lost record.
package inboxkgo

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
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
	// batch, instead of leaving them to the client's auto-commit: fewer
	// re-deliveries after a crash, one more round trip to Kafka per batch.
	CommitEach bool
	// OnError, if set, is called for each failed attempt, with the record
	// that failed; the records before it in its partition are applied and
	// marked, and it is retried with backoff (1 ms doubling to RetryMax)
	// until it succeeds or ctx ends, so records of a partition are never
	// applied out of order. Only that partition waits (it is paused); the
	// others go on. A record whose handler can never succeed stops its
	// partition: make the handler keep it somewhere and return nil if that
	// is what you want. A record no event can be read from
	// (inbox.ParseRecord refuses it) never reaches a handler: it is set
	// aside in the inbox's unparsable table, counted, and its partition
	// goes on.
	OnError func(rec *kgo.Record, err error)
	// OnClientError, if set, is called with each retriable error of a
	// poll (a broker or the group coordinator out of reach, a rebalance)
	// or of a CommitEach commit. Run goes on: the client retries on the
	// next poll, and marked offsets are committed by a later commit.
	OnClientError func(err error)
	// RetryMax caps the backoff; default 5 s.
	RetryMax time.Duration
}

// topicPartition names one partition.
type topicPartition struct {
	topic     string
	partition int32
}

// finished collects the partitions whose batch is done, and cancels the
// armed wait (a poll, or pacing after an error) so Run resumes them
// without waiting for other records.
type finished struct {
	mu     sync.Mutex
	done   []topicPartition
	cancel context.CancelFunc
}

func (f *finished) add(tp topicPartition) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.done = append(f.done, tp)
	if f.cancel != nil {
		f.cancel()
	}
}

// take returns the partitions done since the last take.
func (f *finished) take() []topicPartition {
	f.mu.Lock()
	defer f.mu.Unlock()
	done := f.done
	f.done = nil
	return done
}

// arm returns a context for the next wait that ends when a batch finishes,
// at once if one finished since the last take.
func (f *finished) arm(ctx context.Context) (context.Context, context.CancelFunc) {
	f.mu.Lock()
	defer f.mu.Unlock()
	waitCtx, cancel := context.WithCancel(ctx)
	f.cancel = cancel
	if len(f.done) > 0 {
		cancel()
	}
	return waitCtx, cancel
}

// Run polls and applies records until ctx ends or the client is closed. It
// returns nil when ctx ends or the client is closed, and otherwise the
// error of a poll that is not retriable (an authorization failure, a group
// or topic the broker refuses); retriable ones go to OnClientError, and
// Run keeps polling through an outage. Run waits for the batches it
// started before it returns, and resumes the partitions it paused.
func (c *Consumer) Run(ctx context.Context) error {
	if c.Client == nil || c.Inbox == nil || inbox.IsNil(c.DB) || c.Handler == nil {
		return errors.New("inboxkgo: Client, Inbox, DB and Handler must all be set")
	}
	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	// busy holds the partitions whose batch is being applied (and so are
	// paused); pending, records a poll returned for one of them anyway,
	// applied after it, in order.
	busy := map[topicPartition]bool{}
	pending := map[topicPartition][]*kgo.Record{}
	var done finished
	defer func() {
		cancel()
		wg.Wait()
		if len(busy) > 0 {
			c.Client.ResumeFetchPartitions(partitionMap(busy))
		}
		// With kgo.BlockRebalanceOnPoll, closing the client waits until
		// the last poll's records are released.
		c.Client.AllowRebalance()
	}()
	start := func(tp topicPartition, recs []*kgo.Record) {
		busy[tp] = true
		wg.Go(func() {
			c.apply(runCtx, recs)
			done.add(tp)
		})
	}
	var backoff time.Duration
	// reached: a poll got through to the brokers once. From then on a
	// connection closed at its first read is the network's doing (a
	// broker restarting, a proxy or load balancer dropping connections,
	// a black hole healing), not a listener that wants TLS.
	reached := false
	for {
		resume := map[topicPartition]bool{}
		for _, tp := range done.take() {
			delete(busy, tp)
			if recs := pending[tp]; len(recs) > 0 {
				delete(pending, tp)
				start(tp, recs)
				continue
			}
			resume[tp] = true
		}
		if len(resume) > 0 {
			c.Client.ResumeFetchPartitions(partitionMap(resume))
		}
		pollCtx, stopPoll := done.arm(runCtx)
		fetches := c.Client.PollFetches(pollCtx)
		stopPoll()
		if ctx.Err() != nil || fetches.IsClientClosed() {
			return nil
		}
		var fatal, retriable error
		fetches.EachError(func(topic string, partition int32, err error) {
			switch {
			case pollCtx.Err() != nil && errors.Is(err, context.Canceled):
				// The poll was cut short to resume a partition.
			case isRetriable(err) || reached && isFirstReadEOF(err):
				retriable = err
				if c.OnClientError != nil {
					c.OnClientError(pollError(topic, partition, err))
				}
			case fatal == nil:
				fatal = pollError(topic, partition, err)
			}
		})
		if fatal != nil {
			return fatal
		}
		if retriable == nil {
			reached = true
		}
		polled := map[topicPartition][]*kgo.Record{}
		var order []topicPartition
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) == 0 {
				return
			}
			tp := topicPartition{p.Topic, p.Partition}
			if _, seen := polled[tp]; !seen {
				order = append(order, tp)
			}
			polled[tp] = append(polled[tp], p.Records...)
		})
		pause := map[topicPartition]bool{}
		for _, tp := range order {
			if busy[tp] {
				pending[tp] = append(pending[tp], polled[tp]...)
				continue
			}
			start(tp, polled[tp])
			pause[tp] = true
		}
		if len(pause) > 0 {
			c.Client.PauseFetchPartitions(partitionMap(pause))
		}
		c.Client.AllowRebalance()
		// A poll that brought only a retriable error comes back at once
		// while the client retries: pace it, without holding up a
		// partition that finishes meanwhile.
		if retriable != nil && len(order) == 0 {
			backoff = min(max(2*backoff, 50*time.Millisecond), time.Second)
			if !c.pace(runCtx, &done, backoff) {
				return nil
			}
		} else {
			backoff = 0
		}
	}
}

// pace waits d, or less if a batch finishes, and reports false when ctx
// ended.
func (c *Consumer) pace(ctx context.Context, done *finished, d time.Duration) bool {
	waitCtx, stop := done.arm(ctx)
	defer stop()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-waitCtx.Done():
	}
	return ctx.Err() == nil
}

// apply applies one partition's records in order, marking each once its
// batch committed.
func (c *Consumer) apply(ctx context.Context, recs []*kgo.Record) {
	_ = c.Inbox.ApplyInOrder(ctx, c.DB, inbox.Records{
		Len: len(recs),
		Parse: func(i int) (inbox.Event, error) {
			return inbox.ParseRecord(recs[i].Key, headers(recs[i]), recs[i].Value)
		},
		Applied: func(from, to int) {
			c.Client.MarkCommitRecords(recs[from:to]...)
			if c.CommitEach {
				// A failed commit leaves the marks for the next one.
				if err := c.Client.CommitMarkedOffsets(ctx); err != nil && ctx.Err() == nil && c.OnClientError != nil {
					c.OnClientError(fmt.Errorf("commit offsets: %w", err))
				}
			}
		},
		Failed: func(i int, err error) {
			if c.OnError != nil {
				c.OnError(recs[i], err)
			}
		},
		Raw: func(i int) inbox.RawRecord {
			r := recs[i]
			return inbox.RawRecord{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value, Headers: headers(r)}
		},
	}, c.Handler, c.RetryMax)
}

// isRetriable tells a poll error the client gets over by itself (a broker
// or coordinator out of reach, a connection cut, a rebalance, a broker
// error Kafka marks retriable) from one that needs someone to act.
func isRetriable(err error) bool {
	if _, ok := errors.AsType[*kgo.ErrDataLoss](err); ok {
		return true // a notice: the client resets and goes on
	}
	if ke, ok := errors.AsType[*kerr.Error](err); ok {
		switch ke {
		case kerr.RebalanceInProgress, kerr.IllegalGeneration, kerr.UnknownMemberID:
			return true // the client joins the group again
		}
		return ke.Retriable
	}
	if kgo.IsRetryableBrokerErr(err) {
		return true
	}
	// A dial that failed (connection refused while a broker is down) is
	// left to the caller by IsRetryableBrokerErr; for a long-running
	// consumer it is an outage to wait out.
	if _, ok := errors.AsType[net.Error](err); ok {
		return true
	}
	return false
}

// isFirstReadEOF says the broker closed a connection before answering
// its first request: kgo leaves it to the caller, since at a first
// connection it often means a listener that wants TLS.
func isFirstReadEOF(err error) bool {
	_, ok := errors.AsType[*kgo.ErrFirstReadEOF](err)
	return ok
}

// pollError says where a poll error came from: a partition's fetch, or
// the client as a whole (the group, a closed client), which kgo reports
// with no topic.
func pollError(topic string, partition int32, err error) error {
	if topic == "" {
		return fmt.Errorf("poll: %w", err)
	}
	return fmt.Errorf("fetch %s partition %d: %w", topic, partition, err)
}

func partitionMap(tps map[topicPartition]bool) map[string][]int32 {
	m := map[string][]int32{}
	for tp := range tps {
		m[tp.topic] = append(m[tp.topic], tp.partition)
	}
	return m
}

func headers(rec *kgo.Record) []inbox.Header {
	hs := make([]inbox.Header, len(rec.Headers))
	for i, rh := range rec.Headers {
		hs[i] = inbox.Header{Key: []byte(rh.Key), Value: rh.Value}
	}
	return hs
}
