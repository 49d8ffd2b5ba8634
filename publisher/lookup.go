package publisher

import (
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
// naming no partition.
type Partitioner struct {
	cfg Config

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

// Close closes the client, if it connected.
func (p *Partitioner) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.client == nil {
		return nil
	}
	return p.client.Close()
}
