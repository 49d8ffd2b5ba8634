package publisher

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/event"
)

// Validate checks the Kafka-side settings once, before the relay starts.
// New checks them too, but New runs per session: a setting that can never
// work would fail every session and keep the relay retrying forever instead
// of stopping it with an error that names the flag.
func (c Config) Validate() error {
	for _, b := range c.Brokers {
		if err := validBroker(b); err != nil {
			return fmt.Errorf("--kafka-brokers %q: %w; want host:port, e.g. kafka-1:9092 (comma-separated, no scheme)", b, err)
		}
	}
	if err := validateTopicTemplate(c.TopicTemplate); err != nil {
		return fmt.Errorf("--topic: %w", err)
	}
	if _, err := compressionCodec(c.Compression); err != nil {
		return fmt.Errorf("--compression: %w", err)
	}
	version, err := sarama.ParseKafkaVersion(c.KafkaVersion)
	if err != nil {
		return fmt.Errorf("--kafka-version %q: %w (give the brokers' version, e.g. 3.6.0)", c.KafkaVersion, err)
	}
	if !version.IsAtLeast(sarama.V0_11_0_0) {
		return fmt.Errorf("--kafka-version %s: the relay needs 0.11 or newer for its idempotent producer", c.KafkaVersion)
	}
	// sarama would take these silently (a retry count below 1 became 1 here,
	// a backoff cap of 0 or less retried at once): refuse them instead.
	if c.RetryMax < 1 {
		return fmt.Errorf("--kafka-retry-max %d: must be at least 1 (the idempotent producer needs retries; the default is %d)", c.RetryMax, DefaultConfig().RetryMax)
	}
	if c.RetryBackoffMax <= 0 {
		return fmt.Errorf("--kafka-retry-backoff-max %s: must be positive (the default is %s)", c.RetryBackoffMax, DefaultConfig().RetryBackoffMax)
	}
	if c.Timeout <= 0 {
		return fmt.Errorf("--kafka-timeout %s: must be positive", c.Timeout)
	}
	if c.Linger < 0 || c.Linger > time.Second {
		return fmt.Errorf("--kafka-linger %s: must be between 0 and 1s", c.Linger)
	}
	if err := c.Security.validate(); err != nil {
		return err
	}
	// What is left is how sarama combines the settings (sizes, retries).
	if _, err := saramaConfig(c); err != nil {
		return fmt.Errorf("kafka settings (--kafka-max-message-bytes, --kafka-retry-max, --kafka-linger): %w", err)
	}
	return nil
}

// validateTopicTemplate parses a --topic value and checks that names built
// from it can be valid: placeholders are filled with a valid stand-in, so
// only the template's fixed text can make the name invalid.
func validateTopicTemplate(template string) error {
	t, err := parseTopicTemplate(template)
	if err != nil {
		return err
	}
	standIn := []byte("x")
	sample := t.appendName(nil, &event.Event{AggregateType: standIn, EventType: standIn})
	if err := validTopicName(string(sample)); err != nil {
		return fmt.Errorf("%q cannot form a valid topic name whatever the placeholders hold: %w", template, err)
	}
	return nil
}

// validate checks TLS files and SASL settings the way New applies them,
// and refuses settings that would silently connect with less security than
// asked for: a TLS file without --kafka-tls (plaintext), SASL credentials
// without a mechanism (unauthenticated), PLAIN without TLS (the password
// in the clear) unless explicitly allowed.
func (s Security) validate() error {
	if s.TLS {
		if _, err := s.tlsConfig(); err != nil {
			return fmt.Errorf("--kafka-tls: %w", err)
		}
	} else {
		for _, set := range []struct {
			flag string
			on   bool
		}{
			{"--kafka-tls-ca", s.CA != ""}, {"--kafka-tls-cert", s.Cert != ""}, {"--kafka-tls-key", s.Key != ""},
			{"--kafka-tls-server-name", s.ServerName != ""}, {"--kafka-tls-insecure-skip-verify", s.InsecureSkipVerify},
		} {
			if set.on {
				return fmt.Errorf("%s is set but --kafka-tls is not: the relay would connect in plaintext; add --kafka-tls, or remove %s", set.flag, set.flag)
			}
		}
	}
	if s.SASLMechanism == "" {
		if s.SASLUser != "" || s.SASLPassword != "" {
			return errors.New("a SASL user or password is set but --kafka-sasl-mechanism is not: the relay would connect unauthenticated; set --kafka-sasl-mechanism to PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
		}
		return nil
	}
	saslOnly := s
	saslOnly.TLS = false
	if err := saslOnly.apply(sarama.NewConfig()); err != nil {
		return fmt.Errorf("--kafka-sasl-mechanism %s: %w", s.SASLMechanism, err)
	}
	if s.SASLMechanism == "PLAIN" && !s.TLS && !s.AllowPlainWithoutTLS {
		return errors.New("--kafka-sasl-mechanism PLAIN without --kafka-tls sends the password in the clear: add --kafka-tls, or use SCRAM, or, for a network you trust, --kafka-sasl-plain-without-tls")
	}
	return nil
}

// validBroker checks a bootstrap address the way the client dials it, so
// an address that can never connect stops the relay at start instead of
// failing every connection attempt.
func validBroker(addr string) error {
	if strings.Contains(addr, "://") {
		return errors.New("a URL scheme is not part of a broker address")
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if host == "" || strings.ContainsAny(host, " /\t") {
		return fmt.Errorf("host %q is not a host name or IP address", host)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("port %q is not a number from 1 to 65535", port)
	}
	return nil
}
