package harness

// Apache Kafka node configuration: server.properties, logging, JVM
// arguments, storage format, and finding Java and free ports.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// serverProperties renders node n's server.properties.
func (k *ApacheKafka) serverProperties(n *kafkaNode) string {
	o := k.opts
	var bootstrap []string
	for _, m := range k.nodes {
		bootstrap = append(bootstrap, fmt.Sprintf("127.0.0.1:%d", m.controllerPort))
	}
	listeners := fmt.Sprintf("PLAINTEXT://127.0.0.1:%d,CONTROLLER://127.0.0.1:%d", n.brokerPort, n.controllerPort)
	advertised := fmt.Sprintf("PLAINTEXT://127.0.0.1:%d", n.brokerPort)
	protocols := "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
	if n.toxi != nil {
		// Clients connect to the proxy, which forwards to EXTERNAL; the
		// broker answers a request with the endpoints of the listener it
		// came in on, so clients stay behind the proxy.
		listeners += fmt.Sprintf(",EXTERNAL://127.0.0.1:%d", n.externalPort)
		advertised += ",EXTERNAL://" + n.toxi.Addr()
		protocols += ",EXTERNAL:PLAINTEXT"
	}
	internalRF := strconv.Itoa(min(3, o.Nodes))
	internalISR := strconv.Itoa(min(2, o.Nodes))
	props := [][2]string{
		{"process.roles", "broker,controller"},
		{"node.id", strconv.Itoa(n.id)},
		{"listeners", listeners},
		{"advertised.listeners", advertised},
		{"listener.security.protocol.map", protocols},
		{"inter.broker.listener.name", "PLAINTEXT"},
		{"controller.listener.names", "CONTROLLER"},
		// A dynamic quorum (KIP-853), seeded at format time; see format.
		{"controller.quorum.bootstrap.servers", strings.Join(bootstrap, ",")},
		{"log.dirs", filepath.Join(n.dir, "data")},

		{"auto.create.topics.enable", strconv.FormatBool(o.AutoCreateTopics)},
		{"num.partitions", strconv.Itoa(o.NumPartitions)},
		{"default.replication.factor", strconv.Itoa(o.DefaultReplicationFactor)},
		{"min.insync.replicas", strconv.Itoa(o.MinInsyncReplicas)},
		{"offsets.topic.replication.factor", internalRF},
		{"offsets.topic.num.partitions", "10"},
		{"transaction.state.log.replication.factor", internalRF},
		{"transaction.state.log.min.isr", internalISR},
		{"transaction.state.log.num.partitions", "10"},
		{"share.coordinator.state.topic.replication.factor", internalRF},
		{"share.coordinator.state.topic.min.isr", internalISR},
		{"group.initial.rebalance.delay.ms", "0"},

		// Small footprint: 2 cores shared with PostgreSQL and the tests.
		{"num.network.threads", "2"},
		{"num.io.threads", "2"},
		{"background.threads", "2"},
		{"num.replica.fetchers", "1"},
		{"num.recovery.threads.per.data.dir", "1"},
		{"log.cleaner.threads", "1"},
		{"log.cleaner.dedupe.buffer.size", strconv.Itoa(8 << 20)},
		{"log.segment.bytes", strconv.Itoa(16 << 20)},
		{"log.index.size.max.bytes", strconv.Itoa(1 << 20)},
		{"socket.send.buffer.bytes", "-1"},
		{"socket.receive.buffer.bytes", "-1"},
	}
	var b strings.Builder
	b.WriteString("# Written by the outbox-relay test harness.\n")
	seen := make(map[string]bool)
	for _, p := range props {
		if v, ok := o.Settings[p[0]]; ok {
			p[1] = v
		}
		seen[p[0]] = true
		fmt.Fprintf(&b, "%s=%s\n", p[0], p[1])
	}
	keys := make([]string, 0, len(o.Settings))
	for key := range o.Settings {
		if !seen[key] {
			keys = append(keys, key)
		}
	}
	sort.Strings(keys)
	for _, key := range keys {
		fmt.Fprintf(&b, "%s=%s\n", key, o.Settings[key])
	}
	return b.String()
}

// writeLogConfigs writes both logging configs: Kafka 4.x reads the Log4j 2
// one, 3.x the reload4j (log4j 1.2) one. Both log to stdout, which goes to
// the node's kafka.log.
func (k *ApacheKafka) writeLogConfigs() error {
	const log4j2 = `status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.change.name = state.change.logger
logger.change.level = WARN
`
	const log4j1 = `log4j.rootLogger=INFO, out
log4j.appender.out=org.apache.log4j.ConsoleAppender
log4j.appender.out.layout=org.apache.log4j.PatternLayout
log4j.appender.out.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
`
	if err := os.WriteFile(filepath.Join(k.dir, "log4j2.properties"), []byte(log4j2), 0o644); err != nil {
		return fmt.Errorf("write log4j2 config: %w", err)
	}
	if err := os.WriteFile(filepath.Join(k.dir, "log4j.properties"), []byte(log4j1), 0o644); err != nil {
		return fmt.Errorf("write log4j config: %w", err)
	}
	return nil
}

// jvmArgs returns the java arguments before the main class.
func (k *ApacheKafka) jvmArgs(heapMB int, server bool) []string {
	args := []string{
		fmt.Sprintf("-Xmx%dm", heapMB),
		fmt.Sprintf("-Xms%dm", min(heapMB, 64)),
		"-Xss512k",
	}
	if !server {
		args = append(args, "-XX:+UseSerialGC",
			// C1 only: faster start and far less JIT CPU on a 2-core box.
			"-XX:TieredStopAtLevel=1",
			"-XX:ReservedCodeCacheSize=64m")
	}
	return append(args,
		"-XX:MaxDirectMemorySize=256m",
		"-XX:+ExitOnOutOfMemoryError",
		"-Djava.awt.headless=true",
		"-Djava.net.preferIPv4Stack=true",
		"-Dlog4j2.configurationFile="+filepath.Join(k.dir, "log4j2.properties"),
		"-Dlog4j.configuration=file:"+filepath.Join(k.dir, "log4j.properties"),
		"-Dkafka.logs.dir="+k.dir,
		"-cp", filepath.Join(k.libs, "*"),
	)
}

// format runs kafka.tools.StorageTool on every node. Both 3.9 and 4.x
// accept KIP-853's flags: --standalone for one node, and for more the same
// --initial-controllers list (id@host:port:directory-id) on every node.
func (k *ApacheKafka) format() error {
	var extra []string
	if len(k.nodes) == 1 {
		extra = []string{"--standalone"}
	} else {
		var voters []string
		for _, n := range k.nodes {
			dirID, err := kafkaUUID()
			if err != nil {
				return err
			}
			voters = append(voters, fmt.Sprintf("%d@127.0.0.1:%d:%s", n.id, n.controllerPort, dirID))
		}
		extra = []string{"--initial-controllers", strings.Join(voters, ",")}
	}
	errs := make([]error, len(k.nodes))
	var wg sync.WaitGroup
	for i, n := range k.nodes {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			args := append(k.jvmArgs(128, false), "kafka.tools.StorageTool", "format",
				"-t", k.clusterID, "-c", n.props)
			args = append(args, extra...)
			cmd := exec.CommandContext(ctx, k.java, args...)
			cmd.Dir = n.dir
			out, err := cmd.CombinedOutput()
			if err != nil {
				errs[i] = fmt.Errorf("format node %d: %w: %s", n.id, err, bytes.TrimSpace(out))
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// findJava returns the java binary ($JAVA_HOME/bin/java, else PATH) if it
// is new enough for the Kafka version: 17 for 4.x brokers, 11 for 3.x.
func findJava(version string) (string, error) {
	java := ""
	if home := os.Getenv("JAVA_HOME"); home != "" {
		if p := filepath.Join(home, "bin", "java"); isExecutable(p) {
			java = p
		}
	}
	if java == "" {
		p, err := exec.LookPath("java")
		if err != nil {
			return "", fmt.Errorf("%w: java not found on PATH (install a JDK 17+, e.g. apt-get install openjdk-17-jre-headless)", ErrApacheKafkaUnavailable)
		}
		java = p
	}
	need := 17
	if strings.HasPrefix(version, "3.") {
		need = 11
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, java, "-version").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%w: %s -version: %w", ErrApacheKafkaUnavailable, java, err)
	}
	m := regexp.MustCompile(`version "(1\.)?(\d+)`).FindSubmatch(out)
	if m == nil {
		return "", fmt.Errorf("%w: cannot read java version from %q", ErrApacheKafkaUnavailable, out)
	}
	got, _ := strconv.Atoi(string(m[2]))
	if got < need {
		return "", fmt.Errorf("%w: kafka %s needs java %d+, %s is java %d", ErrApacheKafkaUnavailable, version, need, java, got)
	}
	return java, nil
}

func isExecutable(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

// kafkaUUID returns a random Kafka Uuid in its base64url form, avoiding a
// leading '-' (which the command-line parser would take for a flag).
func kafkaUUID() (string, error) {
	for {
		var b [16]byte
		if _, err := rand.Read(b[:]); err != nil {
			return "", fmt.Errorf("random uuid: %w", err)
		}
		s := base64.RawURLEncoding.EncodeToString(b[:])
		if s[0] != '-' {
			return s, nil
		}
	}
}

// freePorts returns n distinct free TCP ports on 127.0.0.1, holding them
// all open while choosing so that none repeats.
func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("free port: %w", err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
