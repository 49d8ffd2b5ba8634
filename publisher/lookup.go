package publisher

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/event"
)

// TopicNamer resolves the topic an event routes to, with the same template
// the publisher uses, for callers that read topics rather than write them.
type TopicNamer struct {
	t *topicTemplate
}

// NewTopicNamer parses a topic template (--topic).
func NewTopicNamer(template string) (*TopicNamer, error) {
	t, err := parseTopicTemplate(template)
	if err != nil {
		return nil, err
	}
	return &TopicNamer{t: t}, nil
}

// Topic returns the topic of an event.
func (n *TopicNamer) Topic(ev *event.Event) string {
	var scratch [256]byte
	return string(n.t.appendName(scratch[:0], ev))
}

// NewReadClient connects a sarama client with the relay's Kafka settings
// (version, TLS, SASL), for reading topics back. The caller closes it.
func NewReadClient(cfg Config) (sarama.Client, error) {
	sc, err := saramaConfig(cfg)
	if err != nil {
		return nil, err
	}
	sc.Metadata.AllowAutoTopicCreation = false
	sc.Consumer.Return.Errors = true
	client, err := sarama.NewClient(cfg.Brokers, sc)
	if err != nil {
		return nil, ConnectError(cfg, err)
	}
	return client, nil
}

// Partitioner says which partition a record's key goes to, as the producer
// would send it, for the dry run, which sends nothing. It looks up each
// topic's partition count on first use, with a client that creates no
// topic, and connects on the first lookup: a dry run runs without Kafka,
// naming no partition. With UseRecorded, keys are mapped by the count
// recorded for the topic where one is, as the relay maps them.
type Partitioner struct {
	cfg      Config
	recorded RecordedCounts

	mu     sync.Mutex
	client sarama.Client
	// unreachable is the last failure to connect, and retryAt when to try
	// again: until then every record gets it at once, so a dry run without
	// Kafka does not wait --kafka-timeout per record.
	unreachable error
	retryAt     time.Time
	// counts are the topics looked up: a failed lookup is kept too, so a
	// missing topic costs one lookup, not one per record.
	counts map[string]partitionCount
}

type partitionCount struct {
	n   int32
	err error
}

// NewPartitioner returns a partitioner for the brokers of cfg.
func NewPartitioner(cfg Config) *Partitioner {
	return &Partitioner{cfg: cfg, counts: map[string]partitionCount{}}
}

// RecordedCounts reads, and never writes, the partition count recorded
// for an event topic (store.Partitions): 0 when none is recorded.
type RecordedCounts interface {
	Recorded(ctx context.Context, topic string) (int32, error)
}

// UseRecorded has keys mapped by the count r holds for each topic where
// one is recorded, and by the topic's count where none is (the count the
// relay would record on its first record); set it before the first
// Partition. A topic with fewer partitions than recorded gets the error
// the relay stops with.
func (p *Partitioner) UseRecorded(r RecordedCounts) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.recorded = r
}

// Partition is the partition key goes to in topic.
func (p *Partitioner) Partition(topic string, key []byte) (int32, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	count, ok := p.counts[topic]
	if !ok {
		if p.client == nil {
			if time.Now().Before(p.retryAt) {
				return -1, p.unreachable
			}
			client, err := NewReadClient(p.cfg)
			if err != nil {
				p.unreachable, p.retryAt = err, time.Now().Add(time.Minute)
				return -1, err
			}
			p.client = client
		}
		partitions, err := p.client.Partitions(topic)
		count = partitionCount{n: int32(len(partitions))}
		if err != nil {
			count.err = fmt.Errorf("look up topic %s: %w", topic, err)
		} else if p.recorded != nil {
			count = p.recordedCount(topic, count.n)
		}
		p.counts[topic] = count
	}
	if count.err != nil {
		return -1, count.err
	}
	if key == nil {
		return -1, fmt.Errorf("partition record for topic %s: record has no key", topic)
	}
	return JavaPartition(key, count.n), nil
}

// recordedCount is the count keys of topic are mapped by, given the
// topic's count now.
func (p *Partitioner) recordedCount(topic string, actual int32) partitionCount {
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Timeout+10*time.Second)
	defer cancel()
	used, err := p.recorded.Recorded(ctx, topic)
	switch {
	case err != nil:
		return partitionCount{err: fmt.Errorf("read the partition count recorded for topic %s: %w", topic, err)}
	case used > actual:
		return partitionCount{err: &PartitionsShrunkError{Topic: topic, Recorded: used, Have: actual}}
	case used > 0:
		return partitionCount{n: used}
	default:
		return partitionCount{n: actual}
	}
}

// Close closes the client, if it connected.
func (p *Partitioner) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.client == nil {
		return nil
	}
	return p.client.Close()
}
