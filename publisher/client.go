package publisher

import (
	"fmt"

	"github.com/IBM/sarama"
)

// ConnectError explains a failure to connect to the brokers. An
// authentication or certificate failure wraps ErrAuth: retrying in the same
// process cannot fix it.
func ConnectError(brokers []string, err error) error {
	if authFailure(err) {
		return fmt.Errorf("%w: kafka brokers %v refused the relay's credentials or certificate: %v (check the SASL user and password, --kafka-tls-ca and --kafka-tls-server-name)", ErrAuth, brokers, err)
	}
	return fmt.Errorf("connect to kafka brokers %v: %w (check --kafka-brokers, TLS and SASL settings, and that the brokers are up; each wait is bounded by --kafka-timeout, and a listener that accepts connections but never answers, such as a plaintext port under --kafka-tls, fails this way)", brokers, err)
}

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
	if cfg.Timeout > 0 {
		sc.Net.DialTimeout, sc.Net.ReadTimeout, sc.Net.WriteTimeout = cfg.Timeout, cfg.Timeout, cfg.Timeout
		// sarama checks this between attempts, so a lookup ends within
		// about one more request timeout.
		sc.Metadata.Timeout = cfg.Timeout
	}
	if err := cfg.Security.apply(sc); err != nil {
		return nil, err
	}
	return sc, nil
}
