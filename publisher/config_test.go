package publisher

import (
	"errors"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/sink"
)

func TestConfigValidateNamesTheFlag(t *testing.T) {
	valid := DefaultConfig()
	valid.Brokers = []string{"127.0.0.1:9092"}
	if err := valid.Validate(); err != nil {
		t.Fatalf("the defaults do not validate: %v", err)
	}
	for _, tc := range []struct {
		name string
		edit func(*Config)
		flag string
	}{
		{"unknown compression", func(c *Config) { c.Compression = "brotli" }, "--compression"},
		{"unknown placeholder", func(c *Config) { c.TopicTemplate = "outbox.{aggregate}" }, "--topic"},
		{"invalid fixed topic", func(c *Config) { c.TopicTemplate = "bad/topic" }, "--topic"},
		{"invalid template text", func(c *Config) { c.TopicTemplate = "bad/{event_type}" }, "--topic"},
		{"template too long", func(c *Config) { c.TopicTemplate = strings.Repeat("t", 249) + "{event_type}" }, "--topic"},
		{"empty topic", func(c *Config) { c.TopicTemplate = "" }, "--topic"},
		{"unknown kafka version", func(c *Config) { c.KafkaVersion = "banana" }, "--kafka-version"},
		{"kafka version too old", func(c *Config) { c.KafkaVersion = "0.10.2.0" }, "--kafka-version"},
		{"sasl plain without password", func(c *Config) {
			c.Security.SASLMechanism, c.Security.SASLUser = "PLAIN", "relay"
		}, "--kafka-sasl-mechanism"},
		{"unknown sasl mechanism", func(c *Config) {
			c.Security.SASLMechanism, c.Security.SASLUser, c.Security.SASLPassword = "GSSAPI", "relay", "pw"
		}, "--kafka-sasl-mechanism"},
		{"missing tls ca file", func(c *Config) {
			c.Security.TLS, c.Security.CA = true, t.TempDir()+"/missing.pem"
		}, "--kafka-tls"},
		{"zero max message bytes", func(c *Config) { c.MaxMessageBytes = 0 }, "--kafka-max-message-bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := valid
			tc.edit(&c)
			err := c.Validate()
			if err == nil {
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), tc.flag) {
				t.Errorf("error does not name %s: %v", tc.flag, err)
			}
		})
	}
	for _, ok := range []string{"outbox.event.{aggregate_type}", "{aggregate_type}", "{aggregate_type}.{event_type}", "fixed.topic-name_1"} {
		c := valid
		c.TopicTemplate = ok
		if err := c.Validate(); err != nil {
			t.Errorf("--topic %q refused: %v", ok, err)
		}
	}
}

// Issue 24.1: a progress topic the template can produce would mix
// progress records and events in one compacted topic.
func TestTemplateCanName(t *testing.T) {
	for _, tc := range []struct {
		template, topic string
		want            bool
	}{
		{"same.topic", "same.topic", true},
		{"same.topic", "other.topic", false},
		{"outbox.event.{aggregate_type}", "outbox.event.pub", true},
		{"outbox.event.{aggregate_type}", "outbox.event.", false}, // a placeholder is never empty
		{"outbox.event.{aggregate_type}", "outbox-relay.progress", false},
		{"{aggregate_type}", "outbox-relay.progress", true},
		{"{aggregate_type}.{event_type}", "a.b.c", true},
		{"{aggregate_type}.{event_type}", "nodot", false},
		{"x.{event_type}", "xy.z", false}, // '.' is literal, not any character
	} {
		got, err := TemplateCanName(tc.template, tc.topic)
		if err != nil || got != tc.want {
			t.Errorf("TemplateCanName(%q, %q) = %v, %v; want %v", tc.template, tc.topic, got, err, tc.want)
		}
	}
}

// Issue 24.7: PLAIN over plaintext is refused unless asked for by name.
func TestPlainWithoutTLSNeedsItsFlag(t *testing.T) {
	c := DefaultConfig()
	c.Brokers = []string{"127.0.0.1:9092"}
	c.Security.SASLMechanism, c.Security.SASLUser, c.Security.SASLPassword = "PLAIN", "relay", "pw"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "--kafka-sasl-plain-without-tls") {
		t.Fatalf("PLAIN without TLS: %v", err)
	}
	c.Security.AllowPlainWithoutTLS = true
	if err := c.Validate(); err != nil {
		t.Fatalf("PLAIN without TLS, allowed: %v", err)
	}
}

// Issue 24.10: addresses the client can never dial are refused at start.
func TestValidBroker(t *testing.T) {
	for _, ok := range []string{"kafka-1:9092", "127.0.0.1:19092", "[::1]:9092", "k.example.com:1"} {
		if err := validBroker(ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for _, bad := range []string{"not a broker", "http://127.0.0.1:19092", "k1", "k1:", ":9092", "k1:0", "k1:65536", "k1:x"} {
		if err := validBroker(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// Issue 24.15: the quarantine log said "the relay will not skip the event"
// while the stream went on past it.
func TestPermanentAdviceSaysWhereTheEventIs(t *testing.T) {
	advice := recordError(sink.ClassPermanent, "", "", -1, errors.New("refused"), nil).Advice()
	if strings.Contains(advice, "will not skip") || !strings.Contains(advice, "quarantine replay") {
		t.Errorf("advice %q", advice)
	}
}
