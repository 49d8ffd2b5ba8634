package inboxsarama_test

import (
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/inbox/inboxsarama"
)

// sarama's defaults read a JoinGroup answer under a 30 s read timeout while
// the coordinator may hold it for the 60 s rebalance timeout: refused, with
// the setting to change and its bound. NewConfig passes, and so does a
// config whose read timeout was raised instead.
func TestCheckConfigRefusesAJoinGroupReadShorterThanTheRebalance(t *testing.T) {
	err := inboxsarama.CheckConfig(sarama.NewConfig())
	if err == nil {
		t.Fatal("sarama's defaults (read 30s, rebalance 60s) were accepted")
	}
	for _, want := range []string{"Consumer.Group.Rebalance.Timeout to at most 25s", "Net.ReadTimeout to at least 1m5s"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if _, err := inboxsarama.NewConsumerGroup([]string{"127.0.0.1:1"}, "g", sarama.NewConfig()); err == nil ||
		!strings.Contains(err.Error(), "Rebalance.Timeout") {
		t.Errorf("NewConsumerGroup with sarama's defaults: %v, want the configuration refused", err)
	}

	cfg := inboxsarama.NewConfig()
	if err := inboxsarama.CheckConfig(cfg); err != nil {
		t.Errorf("NewConfig refused: %v", err)
	}
	if err := cfg.Validate(); err != nil {
		t.Errorf("NewConfig is not a valid sarama config: %v", err)
	}
	if cfg.Consumer.Offsets.Initial != sarama.OffsetOldest {
		t.Errorf("NewConfig starts a new group at %d, want the oldest offset", cfg.Consumer.Offsets.Initial)
	}

	raised := sarama.NewConfig()
	raised.Net.ReadTimeout = 65 * time.Second
	if err := inboxsarama.CheckConfig(raised); err != nil {
		t.Errorf("read timeout 65s, rebalance 60s refused: %v", err)
	}
	raised.Net.ReadTimeout = 64 * time.Second
	if err := inboxsarama.CheckConfig(raised); err == nil {
		t.Errorf("read timeout 64s, rebalance 60s accepted: less than the margin")
	}
}
