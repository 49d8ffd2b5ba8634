package ops

import (
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// silentEnv is a migrated database with a few outbox rows, and a broker
// address that accepts TCP and never answers.
func silentEnv(t *testing.T) (*env, *harness.SilentListener) {
	t.Helper()
	e := newEnvNoKafka(t)
	silent := harness.StartSilentListener(t)
	e.Brokers = []string{silent.Addr()}
	e.Migrate()
	insert(t, e.DB.DSN(), "order", 3)
	return e, silent
}

// silentCommands are the commands that wait on Kafka, with what each needs.
func silentCommands(e *env) map[string][]string {
	kafka := []string{"--kafka-brokers", strings.Join(e.Brokers, ",")}
	return map[string][]string{
		"status":            e.Args("status", kafka...),
		"quarantine replay": append([]string{"quarantine"}, e.Args("replay", append(kafka, "--all")...)...),
		"reconcile":         e.Args("reconcile", append(kafka, "--since", "1h", "--until", "0s")...),
	}
}

// Issue 24.5: against a broker that accepts TCP and never answers,
// status, quarantine replay --all and reconcile each took 361 s. Every
// Kafka wait is now bounded by --kafka-timeout, and the error names the
// broker.
func TestCommandsAgainstSilentBrokerEndWithinKafkaTimeout(t *testing.T) {
	e, silent := silentEnv(t)
	const timeout = 3 * time.Second
	for name, args := range silentCommands(e) {
		started := time.Now()
		// From the environment: a relay that did not know the setting
		// would still run, and show how long it waits.
		p := harness.StartProcess(t, e.Bin, args, []string{"OUTBOX_RELAY_KAFKA_TIMEOUT=" + timeout.String()})
		// The stated bound is about three timeouts; the margin is start-up
		// and PostgreSQL.
		limit := 3*timeout + 5*time.Second
		code, err := p.Wait(limit)
		took := time.Since(started)
		if err != nil {
			p.Kill()
			t.Errorf("%s: still running after %v against a silent broker", name, limit)
			continue
		}
		t.Logf("%s: exit %d after %v", name, code, took.Round(time.Millisecond))
		if code == 0 || !strings.Contains(p.Output(), silent.Addr()) {
			t.Errorf("%s: exit %d, want a failure naming the broker %s:\n%s", name, code, silent.Addr(), p.Output())
		}
	}
	if silent.Accepted() == 0 {
		t.Error("no command connected to the silent broker")
	}
}

// Issue 24.5: a SIGINT 20 s into a wait on a silent broker was ignored,
// and `run --delivery exactly-once` ignored SIGTERM for 351 s (systemd
// would SIGKILL it). Each now stops within seconds of the signal.
func TestSignalsStopCommandsWaitingOnSilentBroker(t *testing.T) {
	e, silent := silentEnv(t)
	const grace = 5 * time.Second
	stopWithin := func(name string, args []string, sig os.Signal) {
		t.Helper()
		before := silent.Accepted()
		p := harness.StartProcess(t, e.Bin, args, nil)
		// Once connected, it waits for an answer that never comes.
		harness.WaitFor(t, 30*time.Second, name+" connecting to the silent broker", func() bool { return silent.Accepted() > before })
		sent := time.Now()
		if err := p.Signal(sig); err != nil {
			t.Fatalf("%s: signal: %v", name, err)
		}
		if _, err := p.Wait(grace); err != nil {
			p.Kill()
			t.Errorf("%s: still running %v after %v", name, grace, sig)
			return
		}
		t.Logf("%s: stopped %v after %v", name, time.Since(sent).Round(time.Millisecond), sig)
	}
	for name, args := range silentCommands(e) {
		stopWithin(name, args, syscall.SIGINT)
	}
	stopWithin("run --delivery exactly-once", e.Args("run", "--delivery", "exactly-once"), syscall.SIGTERM)
}

// Issue 24.5: `status --kafka-tls` against a plaintext listener took 121 s
// and said only "i/o timeout". It now ends within the stated bound and says
// the listener does not speak TLS.
func TestKafkaTLSAgainstPlaintextListenerSaysSo(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	const timeout = 3 * time.Second
	started := time.Now()
	code, out := harness.RunCommand(t, e.Bin, e.Args("status", "--kafka-brokers", strings.Join(e.Brokers, ","), "--kafka-tls"),
		"OUTBOX_RELAY_KAFKA_TIMEOUT="+timeout.String())
	took := time.Since(started)
	t.Logf("status --kafka-tls against plaintext: exit %d after %v", code, took.Round(time.Millisecond))
	if code != 1 || !strings.Contains(out, "does not speak TLS") || !strings.Contains(out, e.Brokers[0]) {
		t.Fatalf("status exited %d, want 1 saying the listener %s does not speak TLS:\n%s", code, e.Brokers[0], out)
	}
	if limit := 3*timeout + 5*time.Second; took > limit {
		t.Errorf("status took %v, over the stated bound of about three --kafka-timeout (%v)", took, limit)
	}
}

// Issue 24.5: while reconcile waited on a silent broker, its progress log
// went on reporting the finished row phase every 10 s, which hid the
// wait. Each progress line now says when it waits on Kafka, and for what.
func TestReconcileProgressSaysItWaitsOnKafka(t *testing.T) {
	e, silent := silentEnv(t)
	p := harness.StartProcess(t, e.Bin, e.Args("reconcile", "--kafka-brokers", silent.Addr(), "--since", "1h", "--until", "0s",
		"--progress-interval", "200ms"), []string{"OUTBOX_RELAY_KAFKA_TIMEOUT=3s"})
	if code, err := p.Wait(time.Minute); err != nil || code != 1 {
		t.Fatalf("reconcile against a silent broker exited %d (%v), want 1:\n%s", code, err, p.Output())
	}
	want := `"waiting_on":"kafka: connecting to brokers [` + silent.Addr() + `]"`
	if !strings.Contains(p.Output(), want) || !strings.Contains(p.Output(), "reconcile progress: waiting on Kafka") {
		t.Fatalf("no progress line says reconcile waits on Kafka (want %s):\n%s", want, harness.LastLines(p.Output(), 10))
	}
}

// Issue 30: status against a broker that never answers took 90 s with the
// default --kafka-timeout of 30 s, since the client's timeouts apply to
// each connection and request in turn (quarantine replay and reconcile
// too). --kafka-timeout is now the deadline of status's whole Kafka part,
// and of the other commands' connection to Kafka: each must end within
// about one timeout, so the bound asserted here (3x, with start-up and
// PostgreSQL inside it) is one a per-request timeout cannot meet.
func TestOneShotKafkaWaitEndsWithinKafkaTimeout(t *testing.T) {
	e, silent := silentEnv(t)
	const timeout = 2 * time.Second
	for name, args := range silentCommands(e) {
		started := time.Now()
		p := harness.StartProcess(t, e.Bin, append(args, "--kafka-brokers", silent.Addr(), "--kafka-timeout", timeout.String()), nil)
		code, err := p.Wait(time.Minute)
		took := time.Since(started)
		if err != nil {
			p.Kill()
			t.Errorf("%s against a silent broker still running after a minute", name)
			continue
		}
		t.Logf("%s --kafka-timeout %v against a silent broker: exit %d after %v", name, timeout, code, took.Round(time.Millisecond))
		if code != 1 || !strings.Contains(p.Output(), "--kafka-timeout") {
			t.Errorf("%s exited %d, want 1 naming --kafka-timeout:\n%s", name, code, harness.LastLines(p.Output(), 5))
		}
		if limit := 3 * timeout; took >= limit {
			t.Errorf("%s took %v against a silent broker, want under %v with --kafka-timeout %v", name, took.Round(time.Millisecond), limit, timeout)
		}
	}
}
