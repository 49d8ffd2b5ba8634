package publisher

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/internal/await"
	"github.com/outbox-relay/outbox-relay/internal/tcpdial"
	"github.com/outbox-relay/outbox-relay/sink"
)

// ConnectError explains a failure to connect to the brokers. An
// authentication or certificate failure wraps sink.ErrAuth: retrying in the same
// process cannot fix it. Under --kafka-tls it asks each broker, in
// plaintext, whether it speaks Kafka that way: a plaintext listener fails
// the TLS handshake only with a timeout or a closed connection, which names
// nothing.
func ConnectError(cfg Config, err error) error {
	if authFailure(err) {
		return fmt.Errorf("%w: kafka brokers %v refused the relay's credentials or certificate: %v (check the SASL user and password, --kafka-tls-ca and --kafka-tls-server-name)", sink.ErrAuth, cfg.Brokers, err)
	}
	if cfg.Security.TLS {
		for _, broker := range cfg.Brokers {
			if answersPlaintext(broker, min(cfg.Timeout, 3*time.Second)) {
				return fmt.Errorf("connect to kafka broker %s: %w: the listener answers Kafka requests without TLS, so it does not speak TLS: drop --kafka-tls, or point --kafka-brokers at the brokers' TLS listener", broker, err)
			}
		}
	}
	return fmt.Errorf("connect to kafka brokers %v: %w (check --kafka-brokers, TLS and SASL settings, and that the brokers are up; each wait is bounded by --kafka-timeout)", cfg.Brokers, err)
}

// answersPlaintext sends broker an ApiVersions request (v0) without TLS and
// reports whether a Kafka response to it comes back within timeout.
func answersPlaintext(broker string, timeout time.Duration) bool {
	if timeout <= 0 {
		timeout = 3 * time.Second
	}
	conn, err := net.DialTimeout("tcp", broker, timeout)
	if err != nil {
		return false
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(timeout))
	const correlationID = 0x6f727270 // arbitrary; the response must echo it
	clientID := "outbox-relay-tls-probe"
	req := binary.BigEndian.AppendUint16(nil, 18) // ApiVersions
	req = binary.BigEndian.AppendUint16(req, 0)
	req = binary.BigEndian.AppendUint32(req, correlationID)
	req = binary.BigEndian.AppendUint16(req, uint16(len(clientID)))
	req = append(binary.BigEndian.AppendUint32(nil, uint32(len(req)+len(clientID))), append(req, clientID...)...)
	if _, err := conn.Write(req); err != nil {
		return false
	}
	var head [8]byte // size, correlation id
	if _, err := io.ReadFull(conn, head[:]); err != nil {
		return false
	}
	return binary.BigEndian.Uint32(head[4:]) == correlationID
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
	sc.MetricRegistry = newDiscardMetrics(cfg.Throttle)
	sc.Metadata.AllowAutoTopicCreation = false
	if cfg.Timeout > 0 {
		sc.Net.DialTimeout, sc.Net.ReadTimeout, sc.Net.WriteTimeout = cfg.Timeout, cfg.Timeout, cfg.Timeout
		// sarama checks this between attempts, so a lookup ends within
		// about one more request timeout.
		sc.Metadata.Timeout = cfg.Timeout
		// Each request is bounded by its read timeout already; the
		// kernel's own bound also ends a connection to a broker that
		// vanished without closing it while nothing was asked of it.
		sc.Net.Proxy.Enable = true
		sc.Net.Proxy.Dialer = tcpdial.Paced{Dialer: tcpdial.Dialer(cfg.Timeout, cfg.Timeout)}
	}
	if err := cfg.Security.apply(sc); err != nil {
		return nil, err
	}
	return sc, nil
}

// Within runs connect, which may block on Kafka without taking a context,
// and gives up on it once cfg.Timeout has passed or ctx ended; a result
// that arrives later is released. The client's own timeouts apply to each
// connection and request in turn, so a broker that accepts connections and
// never answers held a one-shot command for about three of them: with
// Within, --kafka-timeout bounds the whole wait. what names the wait in
// the error.
func Within[T any](ctx context.Context, cfg Config, what string, connect func() (T, error), release func(T)) (T, error) {
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	v, err := await.Do(ctx, connect, release)
	if errors.Is(err, context.DeadlineExceeded) {
		// ConnectError still tells a plaintext listener under --kafka-tls
		// (it asks each broker once more without TLS).
		return v, ConnectError(cfg, fmt.Errorf("%s: no answer from %s within --kafka-timeout %s (raise it if the brokers are only slow): %w",
			what, strings.Join(cfg.Brokers, ","), cfg.Timeout, err))
	}
	return v, err
}
