package publisher

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"

	"github.com/IBM/sarama"
	"github.com/xdg-go/scram"
)

// Security holds how the relay authenticates to Kafka and protects the link.
type Security struct {
	TLS  bool
	CA   string // PEM file of the CA to trust; the system pool when empty
	Cert string // client certificate PEM file, for mutual TLS
	Key  string // client key PEM file
	// ServerName overrides the name checked in the broker's certificate.
	ServerName string
	// InsecureSkipVerify turns certificate checks off. Never in production.
	InsecureSkipVerify bool

	SASLMechanism string // "", PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
	SASLUser      string
	SASLPassword  string
	// AllowPlainWithoutTLS accepts SASL PLAIN over a plaintext connection,
	// which sends the password in the clear.
	AllowPlainWithoutTLS bool
}

func (s Security) apply(sc *sarama.Config) error {
	if s.TLS {
		tc, err := s.tlsConfig()
		if err != nil {
			return err
		}
		sc.Net.TLS.Enable = true
		sc.Net.TLS.Config = tc
	}
	switch s.SASLMechanism {
	case "":
		return nil
	case sarama.SASLTypePlaintext:
	case sarama.SASLTypeSCRAMSHA256:
		sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{hash: scram.SHA256} }
	case sarama.SASLTypeSCRAMSHA512:
		sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{hash: scram.SHA512} }
	default:
		return fmt.Errorf("kafka sasl mechanism %q: use PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", s.SASLMechanism)
	}
	if s.SASLUser == "" || s.SASLPassword == "" {
		return fmt.Errorf("kafka sasl %s needs a user and a password (--kafka-sasl-user, and the password from OUTBOX_RELAY_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file)", s.SASLMechanism)
	}
	sc.Net.SASL.Enable = true
	sc.Net.SASL.Handshake = true
	sc.Net.SASL.Mechanism = sarama.SASLMechanism(s.SASLMechanism)
	sc.Net.SASL.User = s.SASLUser
	sc.Net.SASL.Password = s.SASLPassword
	return nil
}

func (s Security) tlsConfig() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: s.ServerName, InsecureSkipVerify: s.InsecureSkipVerify}
	if s.CA != "" {
		pem, err := os.ReadFile(s.CA)
		if err != nil {
			return nil, fmt.Errorf("kafka tls ca file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("kafka tls ca file %s: no PEM certificates found", s.CA)
		}
		tc.RootCAs = pool
	}
	if s.Cert != "" || s.Key != "" {
		if s.Cert == "" || s.Key == "" {
			return nil, fmt.Errorf("kafka tls: a client certificate needs both --kafka-tls-cert and --kafka-tls-key")
		}
		pair, err := tls.LoadX509KeyPair(s.Cert, s.Key)
		if err != nil {
			return nil, fmt.Errorf("kafka tls client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{pair}
	}
	return tc, nil
}

// scramClient adapts xdg-go/scram, a maintained SCRAM implementation, to
// sarama's SCRAMClient interface.
type scramClient struct {
	hash scram.HashGeneratorFcn
	conv *scram.ClientConversation
}

func (c *scramClient) Begin(user, password, authzID string) error {
	client, err := c.hash.NewClient(user, password, authzID)
	if err != nil {
		return fmt.Errorf("scram client: %w", err)
	}
	c.conv = client.NewConversation()
	return nil
}

func (c *scramClient) Step(challenge string) (string, error) { return c.conv.Step(challenge) }
func (c *scramClient) Done() bool                            { return c.conv.Done() }
