package publisher

import (
	"fmt"

	"github.com/IBM/sarama"
)

// ClientConfig returns a sarama configuration that reaches the brokers the
// way the producer does (protocol version, client ID, TLS, SASL) and sets
// nothing about producing, for the relay's other clients of the same
// cluster. It never lets a metadata lookup create a topic.
func ClientConfig(cfg Config) (*sarama.Config, error) {
	sc := sarama.NewConfig()
	version, err := sarama.ParseKafkaVersion(cfg.KafkaVersion)
	if err != nil {
		return nil, fmt.Errorf("kafka version %q: %w", cfg.KafkaVersion, err)
	}
	sc.Version = version
	sc.ClientID = cfg.ClientID
	sc.MetricRegistry = newDiscardMetrics()
	sc.Metadata.AllowAutoTopicCreation = false
	if err := cfg.Security.apply(sc); err != nil {
		return nil, err
	}
	return sc, nil
}
