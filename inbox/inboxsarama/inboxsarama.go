// Package inboxsarama runs an inbox.Inbox as a sarama consumer-group
// handler. It marks a record's offset only after the record's transaction
// committed (or after the inbox skipped it as a duplicate), so a crash at
// any moment re-delivers, and the inbox turns the re-delivery into a no-op.
//
// NewConfig and NewConsumerGroup give the group settings a member needs to
// rejoin its group after another member dies (CheckConfig says why sarama's
// own defaults do not).
package inboxsarama

import (
	"context"
	"fmt"
	"time"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// DefaultRebalanceTimeout is the Consumer.Group.Rebalance.Timeout NewConfig
// sets: well inside sarama's default Net.ReadTimeout (30 s) less
// JoinGroupMargin.
const DefaultRebalanceTimeout = 20 * time.Second

// JoinGroupMargin is how much longer than Consumer.Group.Rebalance.Timeout
// CheckConfig wants Net.ReadTimeout to be: the JoinGroup answer comes up to
// the rebalance timeout after the coordinator got the request, and the
// request and answer still have to cross the network.
const JoinGroupMargin = 5 * time.Second

// NewConfig returns sarama's defaults with the group settings a member
// applying records through a Handler needs: Consumer.Group.Rebalance.Timeout
// lowered to DefaultRebalanceTimeout, so it passes CheckConfig, and
// Consumer.Offsets.Initial at the oldest offset, so a new group starts at
// the first event the topic still holds instead of skipping what was
// published before it joined (the inbox skips what it applied already).
// Set Version for your cluster.
//
// The rebalance timeout is lowered rather than the read timeout raised:
// the read timeout bounds every request on the connection (fetches, offset
// commits, metadata), and raising it past a minute would make a broker that
// stopped answering take that long to notice. The rebalance timeout only
// bounds how long the group waits for a member to leave its claims after a
// rebalance starts, and a Handler returns from ConsumeClaim as soon as its
// session ends: an in-flight batch is rolled back with its context and
// comes again to the partition's next owner.
func NewConfig() *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.Consumer.Group.Rebalance.Timeout = DefaultRebalanceTimeout
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	return cfg
}

// CheckConfig returns an error if cfg's group settings let a live member
// fail to rejoin its group, naming the setting to change. sarama reads the
// JoinGroup answer under Net.ReadTimeout (30 s by default), while the
// coordinator may hold that answer until the rebalance ends, up to
// Consumer.Group.Rebalance.Timeout (60 s by default). With sarama's
// defaults, a rebalance that waits for a member that was killed reads as
// an i/o timeout; the member joins again, which starts the rebalance
// again, and the group can keep rebalancing without ever consuming. The
// coordinator waits for the longest rebalance timeout among the group's
// members, so every member needs a config that passes.
func CheckConfig(cfg *sarama.Config) error {
	if cfg == nil {
		return fmt.Errorf("inboxsarama: nil config (use inboxsarama.NewConfig)")
	}
	read, rebalance := cfg.Net.ReadTimeout, cfg.Consumer.Group.Rebalance.Timeout
	if read < rebalance+JoinGroupMargin {
		return fmt.Errorf("inboxsarama: Net.ReadTimeout (%v) must be at least Consumer.Group.Rebalance.Timeout (%v) plus %v, "+
			"or a JoinGroup that waits for a rebalance reads as an i/o timeout and the group can keep rebalancing: "+
			"set Consumer.Group.Rebalance.Timeout to at most %v (inboxsarama.NewConfig sets %v) or Net.ReadTimeout to at least %v",
			read, rebalance, JoinGroupMargin, max(read-JoinGroupMargin, 0), DefaultRebalanceTimeout, rebalance+JoinGroupMargin)
	}
	return nil
}

// NewConsumerGroup is sarama.NewConsumerGroup for a group whose members
// apply records through a Handler: it refuses a cfg that fails CheckConfig.
// A nil cfg means NewConfig().
func NewConsumerGroup(addrs []string, groupID string, cfg *sarama.Config) (sarama.ConsumerGroup, error) {
	if cfg == nil {
		cfg = NewConfig()
	}
	if err := CheckConfig(cfg); err != nil {
		return nil, err
	}
	return sarama.NewConsumerGroup(addrs, groupID, cfg)
}

// Handler is a sarama.ConsumerGroupHandler that applies records through
// an Inbox, in batches: the records of a partition that have arrived, up to
// MaxBatch, go in one transaction (inbox.HandleBatch). Run it in a group
// NewConsumerGroup made, or one whose config passes CheckConfig.
type Handler struct {
	Inbox *inbox.Inbox
	// DB begins each batch's transaction (a *pgxpool.Pool, typically).
	DB      inbox.Beginner
	Handler inbox.Handler
	// CommitEach commits the offset synchronously after every batch,
	// instead of leaving marked offsets to sarama's auto-commit: fewer
	// re-deliveries after a crash, one more round trip to Kafka per batch.
	CommitEach bool
	// OnError, if set, is called for each failed attempt, with the record
	// that failed; the records before it in its batch are applied and
	// marked, and it is retried with backoff (1 ms doubling to RetryMax)
	// until it succeeds or the session ends, so records of a partition are
	// never applied out of order. A record whose handler can never succeed
	// stops its partition: make the handler keep it somewhere and return
	// nil if that is what you want. A record no event can be read from
	// (inbox.ParseRecord refuses it) never reaches a handler: it is set
	// aside in the inbox's unparsable table, counted, and its partition
	// goes on.
	OnError func(msg *sarama.ConsumerMessage, err error)
	// RetryMax caps the backoff; default 5 s.
	RetryMax time.Duration
	// MaxBatch bounds the records applied in one transaction; default
	// DefaultMaxBatch, 1 applies each record alone.
	MaxBatch int
	// BatchWait is how long a batch waits for more records after its
	// first; default 0: a batch takes the records that have arrived, so a
	// backlog goes in large batches and a trickle adds no latency.
	BatchWait time.Duration
}

// DefaultMaxBatch is MaxBatch's default. sarama buffers 256 records per
// partition (Config.ChannelBufferSize), so a larger batch seldom fills.
const DefaultMaxBatch = 256

// Setup implements sarama.ConsumerGroupHandler. It refuses a Handler
// without its Inbox, DB or Handler, so the group's Consume returns that
// error at once instead of a panic on the first record.
func (h *Handler) Setup(sarama.ConsumerGroupSession) error {
	db := !inbox.IsNil(h.DB)
	if h.Inbox == nil || !db || h.Handler == nil {
		return fmt.Errorf("inboxsarama: Handler.Inbox, DB and Handler must all be set (Inbox %t, DB %t, Handler %t)",
			h.Inbox != nil, db, h.Handler != nil)
	}
	return nil
}

// Cleanup implements sarama.ConsumerGroupHandler.
func (h *Handler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim implements sarama.ConsumerGroupHandler.
func (h *Handler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	ctx := sess.Context()
	maxBatch := h.MaxBatch
	if maxBatch <= 0 {
		maxBatch = DefaultMaxBatch
	}
	batch := make([]*sarama.ConsumerMessage, 0, maxBatch)
	for {
		select {
		case <-ctx.Done():
			return nil
		case msg, ok := <-claim.Messages():
			if !ok {
				return nil
			}
			batch, ok = h.fill(ctx, claim.Messages(), append(batch[:0], msg), maxBatch)
			// A session that ends before a record is applied leaves it
			// unmarked, and its next owner gets it again.
			if err := h.apply(ctx, sess, batch); err != nil || !ok {
				return nil
			}
		}
	}
}

// fill adds to batch the records that have arrived, up to maxBatch, waiting
// up to BatchWait for more. It reports false once the channel is closed.
func (h *Handler) fill(ctx context.Context, msgs <-chan *sarama.ConsumerMessage, batch []*sarama.ConsumerMessage, maxBatch int) ([]*sarama.ConsumerMessage, bool) {
	var deadline <-chan time.Time
	if h.BatchWait > 0 {
		t := time.NewTimer(h.BatchWait)
		defer t.Stop()
		deadline = t.C
	}
	for len(batch) < maxBatch {
		select {
		case msg, ok := <-msgs:
			if !ok {
				return batch, false
			}
			batch = append(batch, msg)
			continue
		default:
		}
		if deadline == nil {
			return batch, true
		}
		select {
		case msg, ok := <-msgs:
			if !ok {
				return batch, false
			}
			batch = append(batch, msg)
		case <-deadline:
			return batch, true
		case <-ctx.Done():
			return batch, true
		}
	}
	return batch, true
}

// apply applies msgs, marking each record's offset once its batch
// committed (or the inbox skipped it), and retries from the first record
// that failed until all are applied or ctx ends.
func (h *Handler) apply(ctx context.Context, sess sarama.ConsumerGroupSession, msgs []*sarama.ConsumerMessage) error {
	return h.Inbox.ApplyInOrder(ctx, h.DB, inbox.Records{
		Len: len(msgs),
		Parse: func(i int) (inbox.Event, error) {
			return inbox.ParseRecord(msgs[i].Key, headers(msgs[i]), msgs[i].Value)
		},
		Applied: func(from, to int) {
			for _, msg := range msgs[from:to] {
				sess.MarkMessage(msg, "")
			}
			if h.CommitEach {
				sess.Commit()
			}
		},
		Failed: func(i int, err error) {
			if h.OnError != nil {
				h.OnError(msgs[i], err)
			}
		},
		Raw: func(i int) inbox.RawRecord {
			m := msgs[i]
			return inbox.RawRecord{Topic: m.Topic, Partition: m.Partition, Offset: m.Offset, Key: m.Key, Value: m.Value, Headers: headers(m)}
		},
	}, h.Handler, h.RetryMax)
}

func headers(msg *sarama.ConsumerMessage) []inbox.Header {
	hs := make([]inbox.Header, len(msg.Headers))
	for i, rh := range msg.Headers {
		hs[i] = inbox.Header{Key: rh.Key, Value: rh.Value}
	}
	return hs
}
