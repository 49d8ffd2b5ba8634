package ops

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Kafka settings that can never work stop `run` at start-up with exit 2
// and the flag's name, before READY=1 could ever be due: they used to be
// checked per session, so the relay retried forever and systemd killed it
// every TimeoutStartSec. Nothing listens at the broker address, so a relay
// that got past validation would retry instead of exiting.
func TestDeployRefusesBadKafkaSettingsAtStartUp(t *testing.T) {
	t.Parallel()
	bin := harness.BuildRelay(t)
	base := []string{"run", "--pg-dsn", cluster.DSN("postgres"), "--kafka-brokers", "127.0.0.1:1", "--admin-addr", ""}
	for _, tc := range []struct {
		flags []string
		named string
	}{
		{[]string{"--compression", "brotli"}, "--compression"},
		{[]string{"--topic", "outbox.{aggregate}"}, "--topic"},
		{[]string{"--topic", "bad/topic"}, "--topic"},
		{[]string{"--kafka-version", "banana"}, "--kafka-version"},
		{[]string{"--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-user", "relay"}, "--kafka-sasl-mechanism"},
	} {
		t.Run(tc.named+" "+tc.flags[1], func(t *testing.T) {
			sock := listenNotify(t)
			p := harness.StartProcess(t, bin, append(base, tc.flags...), sock.env(0))
			code, err := p.Wait(30 * time.Second)
			if err != nil || code != 2 {
				t.Fatalf("exit %d (%v), want 2 at start-up:\n%s", code, err, harness.LastLines(p.Output(), 10))
			}
			if !strings.Contains(p.Output(), tc.named) {
				t.Errorf("the error does not name %s:\n%s", tc.named, p.Output())
			}
			if sock.count("READY=1") != 0 {
				t.Errorf("READY=1 sent:\n%s", sock.lines())
			}
		})
	}
}
