package publisher

import (
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
