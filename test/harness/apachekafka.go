package harness

// Apache Kafka for end-to-end tests.
//
// Real brokers in KRaft mode, run from jars that test/kafka/fetch.sh put in
// ${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay/kafka-<version>/libs. Each
// node is one JVM acting as broker and controller ("combined" mode); a
// cluster of N nodes forms one KRaft quorum of N voters. Everything listens
// on 127.0.0.1 only.
//
// Starting a cluster takes seconds, so tests share one per package run via
// SharedApacheKafka or RequireApacheKafka. Every cluster registers its
// Close with the harness cleanup registry, so a TestMain that uses Main
// stops them all after the tests (or on SIGINT/SIGTERM); a TestMain that
// does not use Main should call CloseSharedApacheKafka after m.Run. If the
// test binary dies anyway, the JVMs die with it (they are started with a
// parent-death signal) and the next Main deletes their temp dirs.
//
// This file is Linux-only in practice: it uses process groups and
// SysProcAttr.Pdeathsig.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// The Apache Kafka versions the tests use; test/kafka/fetch.sh fetches both
// by default. 4.x is the current protocol generation (KIP-896 removed old
// request versions); 3.9 is the last release of the previous one.
const (
	ApacheKafka4Version = "4.4.0"
	ApacheKafka3Version = "3.9.2"
)

// RequireApacheKafkaEnv names the environment variable that, when "1",
// makes RequireApacheKafka fail a test instead of skipping it when Apache
// Kafka cannot be started here. CI sets it.
const RequireApacheKafkaEnv = "OUTBOX_RELAY_REQUIRE_APACHE_KAFKA"

// ErrApacheKafkaUnavailable is wrapped by errors that mean Apache Kafka
// cannot run on this machine as it is (jars not fetched, no suitable Java),
// as opposed to a cluster that was tried and failed.
var ErrApacheKafkaUnavailable = errors.New("apache kafka unavailable")

// ApacheKafkaOptions describe a cluster. The zero value is one 4.x node.
type ApacheKafkaOptions struct {
	// Version is the Kafka release; "" means ApacheKafka4Version.
	Version string
	// Nodes is the number of combined broker+controller nodes, all voters
	// of one KRaft quorum; 0 means 1.
	Nodes int
	// MinInsyncReplicas is the broker default min.insync.replicas; 0 means 1.
	MinInsyncReplicas int
	// DefaultReplicationFactor is default.replication.factor; 0 means
	// min(3, Nodes).
	DefaultReplicationFactor int
	// AutoCreateTopics sets auto.create.topics.enable.
	AutoCreateTopics bool
	// NumPartitions is num.partitions for auto-created topics; 0 means 1.
	NumPartitions int
	// HeapMB is each JVM's -Xmx in MiB; 0 means 384.
	HeapMB int
	// ServerJVM runs the broker with the JVM's own JIT (tiered C1 and C2)
	// and garbage collector (G1), as a production broker runs. The default
	// is lean for tests on two cores: C1 only and the serial collector,
	// which start fast and burn little CPU but serve each request slower.
	ServerJVM bool
	// Settings are extra server.properties entries, applied last.
	Settings map[string]string
	// StartTimeout bounds the wait for the cluster (or a restarted node)
	// to be ready; 0 means 120s.
	StartTimeout time.Duration
}

func (o ApacheKafkaOptions) withDefaults() ApacheKafkaOptions {
	if o.Version == "" {
		o.Version = ApacheKafka4Version
	}
	if o.Nodes <= 0 {
		o.Nodes = 1
	}
	if o.MinInsyncReplicas <= 0 {
		o.MinInsyncReplicas = 1
	}
	if o.DefaultReplicationFactor <= 0 {
		o.DefaultReplicationFactor = min(3, o.Nodes)
	}
	if o.NumPartitions <= 0 {
		o.NumPartitions = 1
	}
	if o.HeapMB <= 0 {
		o.HeapMB = 384
	}
	if o.StartTimeout <= 0 {
		o.StartTimeout = 120 * time.Second
	}
	return o
}

// key identifies options for SharedApacheKafka, after defaults.
func (o ApacheKafkaOptions) key() string {
	o = o.withDefaults()
	var b strings.Builder
	fmt.Fprintf(&b, "v=%s n=%d isr=%d rf=%d auto=%t parts=%d heap=%d server=%t timeout=%s",
		o.Version, o.Nodes, o.MinInsyncReplicas, o.DefaultReplicationFactor,
		o.AutoCreateTopics, o.NumPartitions, o.HeapMB, o.ServerJVM, o.StartTimeout)
	keys := make([]string, 0, len(o.Settings))
	for k := range o.Settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%s", k, o.Settings[k])
	}
	return b.String()
}

// ApacheKafkaLibs returns the directory holding the jars of the given
// version, as left by test/kafka/fetch.sh, or an error wrapping
// ErrApacheKafkaUnavailable when they are not there.
func ApacheKafkaLibs(version string) (string, error) {
	if version == "" {
		version = ApacheKafka4Version
	}
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("%w: locate cache dir: %w", ErrApacheKafkaUnavailable, err)
		}
		cache = filepath.Join(home, ".cache")
	}
	base := filepath.Join(cache, "outbox-relay", "kafka-"+version)
	libs := filepath.Join(base, "libs")
	if _, err := os.Stat(filepath.Join(base, "fetched.stamp")); err != nil {
		return "", fmt.Errorf("%w: kafka %s jars not found in %s: run test/kafka/fetch.sh %s",
			ErrApacheKafkaUnavailable, version, libs, version)
	}
	jar := filepath.Join(libs, "kafka_2.13-"+version+".jar")
	if _, err := os.Stat(jar); err != nil {
		return "", fmt.Errorf("%w: kafka %s cache in %s is incomplete: rerun test/kafka/fetch.sh %s",
			ErrApacheKafkaUnavailable, version, libs, version)
	}
	return libs, nil
}

// ApacheKafka is a running Apache Kafka cluster of one or more nodes.
// Node i (0-based) has node.id i. Methods are safe for concurrent use, but
// node operations (KillNode, StopNode, StartNode) are serialised.
type ApacheKafka struct {
	opts      ApacheKafkaOptions
	java      string
	libs      string
	dir       string
	clusterID string
	nodes     []*kafkaNode
	adm       *kadm.Client
	cl        *kgo.Client
	startup   time.Duration

	unregister func() // removes Close from Main's cleanup registry

	mu        sync.Mutex // guards node processes and closed
	closed    bool
	keepDir   bool
	closeOnce sync.Once
}

type kafkaNode struct {
	id             int
	brokerPort     int
	controllerPort int
	dir            string
	props          string
	logPath        string

	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has exited
	err  error         // cmd.Wait result, set before done is closed
}

func (n *kafkaNode) running() bool {
	if n.cmd == nil {
		return false
	}
	select {
	case <-n.done:
		return false
	default:
		return true
	}
}

// StartApacheKafka formats and starts a new cluster and waits until every
// node serves requests. Errors that mean Kafka cannot run here at all wrap
// ErrApacheKafkaUnavailable. The caller must Close the cluster.
func StartApacheKafka(opts ApacheKafkaOptions) (*ApacheKafka, error) {
	opts = opts.withDefaults()
	libs, err := ApacheKafkaLibs(opts.Version)
	if err != nil {
		return nil, err
	}
	java, err := findJava(opts.Version)
	if err != nil {
		return nil, err
	}
	// An owned dir: Main in a later test binary deletes it if this one dies.
	dir, err := makeOwnedTempDir("outbox-relay-kafka-" + opts.Version + "-")
	if err != nil {
		return nil, err
	}
	k := &ApacheKafka{opts: opts, java: java, libs: libs, dir: dir}
	// Main closes whatever the tests left running (also on SIGINT/SIGTERM).
	k.unregister = registerCleanup(k.Close)
	began := time.Now()
	if err := k.start(); err != nil {
		// Keep the logs for diagnosis; only the processes go.
		k.keepDir = true
		k.Close()
		return nil, fmt.Errorf("start apache kafka %s (%d nodes, logs kept in %s): %w",
			opts.Version, opts.Nodes, dir, err)
	}
	k.startup = time.Since(began)
	return k, nil
}

func (k *ApacheKafka) start() error {
	var err error
	if k.clusterID, err = kafkaUUID(); err != nil {
		return err
	}
	ports, err := freePorts(2 * k.opts.Nodes)
	if err != nil {
		return err
	}
	for i := range k.opts.Nodes {
		n := &kafkaNode{
			id:             i,
			brokerPort:     ports[2*i],
			controllerPort: ports[2*i+1],
			dir:            filepath.Join(k.dir, fmt.Sprintf("node-%d", i)),
		}
		n.props = filepath.Join(n.dir, "server.properties")
		n.logPath = filepath.Join(n.dir, "kafka.log")
		if err := os.MkdirAll(n.dir, 0o755); err != nil {
			return fmt.Errorf("create node dir: %w", err)
		}
		k.nodes = append(k.nodes, n)
	}
	if err := k.writeLogConfigs(); err != nil {
		return err
	}
	for _, n := range k.nodes {
		if err := os.WriteFile(n.props, []byte(k.serverProperties(n)), 0o644); err != nil {
			return fmt.Errorf("write server.properties: %w", err)
		}
	}
	if err := k.format(); err != nil {
		return err
	}

	cl, err := kgo.NewClient(
		kgo.SeedBrokers(k.Brokers()...),
		kgo.DialTimeout(3*time.Second),
		kgo.RequestTimeoutOverhead(5*time.Second),
		kgo.RetryTimeout(10*time.Second),
		kgo.MetadataMinAge(250*time.Millisecond),
	)
	if err != nil {
		return fmt.Errorf("admin client: %w", err)
	}
	k.cl = cl
	k.adm = kadm.NewClient(cl)

	k.mu.Lock()
	for _, n := range k.nodes {
		if err := k.launch(n); err != nil {
			k.mu.Unlock()
			return err
		}
	}
	k.mu.Unlock()

	ctx, cancel := context.WithTimeout(context.Background(), k.opts.StartTimeout)
	defer cancel()
	return k.waitReady(ctx, -1)
}

// serverProperties renders node n's server.properties.
func (k *ApacheKafka) serverProperties(n *kafkaNode) string {
	o := k.opts
	var bootstrap []string
	for _, m := range k.nodes {
		bootstrap = append(bootstrap, fmt.Sprintf("127.0.0.1:%d", m.controllerPort))
	}
	internalRF := strconv.Itoa(min(3, o.Nodes))
	internalISR := strconv.Itoa(min(2, o.Nodes))
	props := [][2]string{
		{"process.roles", "broker,controller"},
		{"node.id", strconv.Itoa(n.id)},
		{"listeners", fmt.Sprintf("PLAINTEXT://127.0.0.1:%d,CONTROLLER://127.0.0.1:%d", n.brokerPort, n.controllerPort)},
		{"advertised.listeners", fmt.Sprintf("PLAINTEXT://127.0.0.1:%d", n.brokerPort)},
		{"listener.security.protocol.map", "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"},
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

// launch starts node n's JVM. k.mu must be held.
func (k *ApacheKafka) launch(n *kafkaNode) error {
	logf, err := os.OpenFile(n.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open node log: %w", err)
	}
	fmt.Fprintf(logf, "==== harness: starting node %d at %s ====\n", n.id, time.Now().Format(time.RFC3339Nano))
	args := append(k.jvmArgs(k.opts.HeapMB, k.opts.ServerJVM), "kafka.Kafka", n.props)
	cmd := exec.Command(k.java, args...)
	cmd.Dir = n.dir
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid: true,
		// Do not outlive the test binary, even if it dies without cleanup.
		Pdeathsig: syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start node %d: %w", n.id, err)
	}
	done := make(chan struct{})
	n.cmd, n.done, n.err = cmd, done, nil
	go func() {
		err := cmd.Wait()
		logf.Close()
		n.err = err
		close(done)
	}()
	return nil
}

// Brokers returns the brokers' host:port addresses, indexed by node.
func (k *ApacheKafka) Brokers() []string {
	out := make([]string, len(k.nodes))
	for i, n := range k.nodes {
		out[i] = fmt.Sprintf("127.0.0.1:%d", n.brokerPort)
	}
	return out
}

// BrokerList returns Brokers joined by commas.
func (k *ApacheKafka) BrokerList() string { return strings.Join(k.Brokers(), ",") }

// Version returns the cluster's Kafka version.
func (k *ApacheKafka) Version() string { return k.opts.Version }

// StartupTime returns how long StartApacheKafka took, format included.
func (k *ApacheKafka) StartupTime() time.Duration { return k.startup }

// PIDs returns the process IDs of the running broker JVMs, for measuring
// their CPU.
func (k *ApacheKafka) PIDs() []int {
	var pids []int
	for _, n := range k.nodes {
		if n.cmd != nil && n.cmd.Process != nil {
			pids = append(pids, n.cmd.Process.Pid)
		}
	}
	return pids
}

// Nodes returns the number of nodes.
func (k *ApacheKafka) Nodes() int { return len(k.nodes) }

// Dir returns the cluster's temp dir (node-<i>/kafka.log are the logs).
func (k *ApacheKafka) Dir() string { return k.dir }

func (k *ApacheKafka) node(i int) *kafkaNode {
	if i < 0 || i >= len(k.nodes) {
		panic(fmt.Sprintf("harness: apache kafka node %d out of range [0,%d)", i, len(k.nodes)))
	}
	return k.nodes[i]
}

// KillNode kills node i with SIGKILL and waits for it to exit. It does
// nothing if the node is not running.
func (k *ApacheKafka) KillNode(i int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.stop(k.node(i), 0)
}

// StopNode stops node i gracefully (SIGTERM, so a controlled shutdown),
// falling back to SIGKILL after 30s. It does nothing if the node is not
// running.
func (k *ApacheKafka) StopNode(i int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.stop(k.node(i), 30*time.Second)
}

// stop signals n's process group: SIGTERM, then SIGKILL after grace (at
// once if grace is 0). k.mu must be held.
func (k *ApacheKafka) stop(n *kafkaNode, grace time.Duration) {
	if !n.running() {
		return
	}
	pgid := n.cmd.Process.Pid
	if grace > 0 {
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case <-n.done:
			return
		case <-time.After(grace):
		}
	}
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	<-n.done
}

// StartNode restarts a stopped or killed node i on its old ports and data
// dir, and waits until it is registered again and back in the ISR of every
// partition it hosts.
func (k *ApacheKafka) StartNode(i int) error {
	k.mu.Lock()
	n := k.node(i)
	if k.closed {
		k.mu.Unlock()
		return errors.New("start node: cluster closed")
	}
	if n.running() {
		k.mu.Unlock()
		return fmt.Errorf("start node %d: already running", i)
	}
	err := k.launch(n)
	k.mu.Unlock()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), k.opts.StartTimeout)
	defer cancel()
	if err := k.waitReady(ctx, i); err != nil {
		return fmt.Errorf("restart node %d: %w", i, err)
	}
	return nil
}

// waitReady polls until every running node is a registered broker that
// answers requests itself, and then until the cluster can create and
// describe a topic (restarted < 0), or until node restarted is back in the
// ISR of every partition it is a replica of.
func (k *ApacheKafka) waitReady(ctx context.Context, restarted int) error {
	var last error
	probe := ""
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		if err := k.checkAlive(); err != nil {
			return err
		}
		last = k.readyOnce(ctx, restarted, &probe)
		if last == nil {
			if probe != "" {
				dctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
				_, _ = k.adm.DeleteTopics(dctx, probe)
				cancel()
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not ready: %w (last: %w)%s", ctx.Err(), last, k.allLogTails(15))
		case <-tick.C:
		}
	}
}

func (k *ApacheKafka) readyOnce(ctx context.Context, restarted int, probe *string) error {
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	md, err := k.metadata(rctx, restarted >= 0)
	if err != nil {
		return err
	}
	have := make(map[int32]bool)
	var ids []int32
	for _, b := range md.Brokers {
		have[b.NodeID] = true
		ids = append(ids, b.NodeID)
	}
	want := k.runningIDs()
	for _, id := range want {
		if !have[int32(id)] {
			return fmt.Errorf("broker %d not registered (have %v)", id, ids)
		}
	}
	// A registration can outlive a killed process by the session timeout,
	// so also hear from every running node itself.
	for _, id := range want {
		req := kmsg.NewPtrApiVersionsRequest()
		if _, err := k.cl.Broker(id).Request(rctx, req); err != nil {
			return fmt.Errorf("node %d does not answer: %w", id, err)
		}
	}
	if restarted >= 0 {
		return replicaInSync(md, int32(restarted))
	}
	if *probe == "" {
		*probe = "__harness_ready_" + strconv.FormatInt(time.Now().UnixNano(), 36)
		rf := int16(min(3, len(want)))
		if _, err := k.adm.CreateTopic(rctx, int32(len(want)), rf, nil, *probe); err != nil {
			*probe = ""
			return fmt.Errorf("create probe topic: %w", err)
		}
	}
	return k.topicReady(rctx, *probe)
}

// metadata asks a broker directly, for all topics or none. kadm's
// metadata calls go through kgo's metadata cache, which can keep serving a
// stale broker list or ISR, so the harness never uses them.
func (k *ApacheKafka) metadata(ctx context.Context, allTopics bool, topics ...string) (*kmsg.MetadataResponse, error) {
	req := kmsg.NewPtrMetadataRequest()
	if !allTopics {
		req.Topics = []kmsg.MetadataRequestTopic{}
		for _, t := range topics {
			rt := kmsg.NewMetadataRequestTopic()
			rt.Topic = kmsg.StringPtr(t)
			req.Topics = append(req.Topics, rt)
		}
	}
	resp, err := req.RequestWith(ctx, k.cl)
	if err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	return resp, nil
}

// inSync checks that every partition of the listed topics has a leader
// and a full ISR.
func inSync(md *kmsg.MetadataResponse, only []string) error {
	seen := 0
	for _, t := range md.Topics {
		name := ""
		if t.Topic != nil {
			name = *t.Topic
		}
		if !slices.Contains(only, name) {
			continue
		}
		seen++
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
			return fmt.Errorf("topic %s: %w", name, err)
		}
		if len(t.Partitions) == 0 {
			return fmt.Errorf("topic %s has no partitions yet", name)
		}
		for _, p := range t.Partitions {
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				return fmt.Errorf("topic %s partition %d: %w", name, p.Partition, err)
			}
			if p.Leader < 0 || len(p.ISR) < len(p.Replicas) {
				return fmt.Errorf("topic %s partition %d not in sync: leader %d isr %v replicas %v",
					name, p.Partition, p.Leader, p.ISR, p.Replicas)
			}
		}
	}
	if seen < len(only) {
		return fmt.Errorf("topics %v not all in metadata yet", only)
	}
	return nil
}

// replicaInSync checks that node is in the ISR of every partition it is a
// replica of. Other replicas may still be down.
func replicaInSync(md *kmsg.MetadataResponse, node int32) error {
	for _, t := range md.Topics {
		for _, p := range t.Partitions {
			if slices.Contains(p.Replicas, node) && !slices.Contains(p.ISR, node) {
				return fmt.Errorf("node %d not yet in the isr %v of %s/%d", node, p.ISR, *t.Topic, p.Partition)
			}
		}
	}
	return nil
}

// topicReady checks that every partition of topic has a leader and a full
// ISR.
func (k *ApacheKafka) topicReady(ctx context.Context, topic string) error {
	md, err := k.metadata(ctx, false, topic)
	if err != nil {
		return err
	}
	return inSync(md, []string{topic})
}

func (k *ApacheKafka) runningIDs() []int {
	k.mu.Lock()
	defer k.mu.Unlock()
	var ids []int
	for _, n := range k.nodes {
		if n.running() {
			ids = append(ids, n.id)
		}
	}
	return ids
}

// checkAlive reports a node that was started and exited on its own.
func (k *ApacheKafka) checkAlive() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, n := range k.nodes {
		if n.cmd != nil && !n.running() {
			return fmt.Errorf("node %d exited: %v%s", n.id, n.err, k.logTailLocked(n, 40))
		}
	}
	return nil
}

// CreateTopic creates a topic and waits until every partition has a leader
// and a full ISR. replicationFactor -1 and partitions -1 mean the broker
// defaults.
func (k *ApacheKafka) CreateTopic(name string, partitions int32, replicationFactor int16, configs map[string]string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var cfg map[string]*string
	if len(configs) > 0 {
		cfg = make(map[string]*string, len(configs))
		for key, v := range configs {
			cfg[key] = kadm.StringPtr(v)
		}
	}
	if _, err := k.adm.CreateTopic(ctx, partitions, replicationFactor, cfg, name); err != nil {
		return fmt.Errorf("create topic %s: %w", name, err)
	}
	for {
		err := k.topicReady(ctx, name)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("create topic %s: not ready: %w", name, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// PartitionLeader returns the index of the node leading the partition,
// as a broker sees it now.
func (k *ApacheKafka) PartitionLeader(topic string, partition int32) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	md, err := k.metadata(ctx, false, topic)
	if err != nil {
		return -1, fmt.Errorf("partition leader: %w", err)
	}
	for _, t := range md.Topics {
		if t.Topic == nil || *t.Topic != topic {
			continue
		}
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
			return -1, fmt.Errorf("partition leader: topic %s: %w", topic, err)
		}
		for _, p := range t.Partitions {
			if p.Partition != partition {
				continue
			}
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				return -1, fmt.Errorf("partition leader: %s/%d: %w", topic, partition, err)
			}
			if p.Leader < 0 || int(p.Leader) >= len(k.nodes) {
				return -1, fmt.Errorf("partition leader: %s/%d has no leader (%d)", topic, partition, p.Leader)
			}
			return int(p.Leader), nil
		}
		return -1, fmt.Errorf("partition leader: %s/%d does not exist", topic, partition)
	}
	return -1, fmt.Errorf("partition leader: topic %s not in metadata", topic)
}

// LogTail returns the last n lines of node i's log.
func (k *ApacheKafka) LogTail(i, n int) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.logTailLocked(k.node(i), n)
}

func (k *ApacheKafka) logTailLocked(node *kafkaNode, n int) string {
	f, err := os.Open(node.logPath)
	if err != nil {
		return fmt.Sprintf("\n(no log for node %d: %v)", node.id, err)
	}
	defer f.Close()
	// The tail of a big log is in its last few hundred KiB.
	if st, err := f.Stat(); err == nil && st.Size() > 512<<10 {
		_, _ = f.Seek(st.Size()-512<<10, io.SeekStart)
	}
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > 4*n+1024 {
			lines = lines[len(lines)-n:]
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return fmt.Sprintf("\n--- node %d log tail (%s) ---\n%s", node.id, node.logPath, strings.Join(lines, "\n"))
}

func (k *ApacheKafka) allLogTails(n int) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var b strings.Builder
	for _, node := range k.nodes {
		b.WriteString(k.logTailLocked(node, n))
	}
	return b.String()
}

// Close stops every node (SIGTERM, then SIGKILL after 15s) and removes the
// temp dir. It is safe to call more than once.
func (k *ApacheKafka) Close() {
	k.closeOnce.Do(func() {
		if k.unregister != nil {
			k.unregister()
		}
		if k.cl != nil {
			k.cl.Close()
		}
		k.mu.Lock()
		k.closed = true
		var wg sync.WaitGroup
		for _, n := range k.nodes {
			wg.Go(func() { k.stop(n, 15*time.Second) })
		}
		wg.Wait()
		k.mu.Unlock()
		if !k.keepDir {
			_ = os.RemoveAll(k.dir)
		}
	})
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

// The shared clusters: package state, since a package's tests share one
// cluster per options for the whole run. CloseSharedApacheKafka ends them.
var (
	sharedMu    sync.Mutex
	sharedKafka = map[string]*sharedEntry{}
)

type sharedEntry struct {
	once sync.Once
	k    *ApacheKafka
	err  error
}

// SharedApacheKafka returns a cluster for opts, starting it on first use
// and reusing it (or its start error) for later calls with equal options.
// Tests that stop or kill nodes of a shared cluster must start them again
// before they end. Main closes shared clusters after the tests; without
// Main, call CloseSharedApacheKafka after m.Run.
func SharedApacheKafka(opts ApacheKafkaOptions) (*ApacheKafka, error) {
	key := opts.key()
	sharedMu.Lock()
	e, ok := sharedKafka[key]
	if !ok {
		e = &sharedEntry{}
		sharedKafka[key] = e
	}
	sharedMu.Unlock()
	e.once.Do(func() { e.k, e.err = StartApacheKafka(opts) })
	return e.k, e.err
}

// CloseSharedApacheKafka closes every cluster SharedApacheKafka started
// and forgets them. Main does the same through the cleanup registry; call
// this from a TestMain that does not use Main, after m.Run.
func CloseSharedApacheKafka() {
	sharedMu.Lock()
	entries := sharedKafka
	sharedKafka = map[string]*sharedEntry{}
	sharedMu.Unlock()
	var wg sync.WaitGroup
	for _, e := range entries {
		wg.Go(func() {
			e.once.Do(func() {}) // wait for a start in progress
			if e.k != nil {
				e.k.Close()
			}
		})
	}
	wg.Wait()
}

// RequireApacheKafka returns the shared cluster for opts. If Apache Kafka
// cannot run here (ErrApacheKafkaUnavailable), the test is skipped with the
// reason, or failed when OUTBOX_RELAY_REQUIRE_APACHE_KAFKA=1. Any other
// start error fails the test.
func RequireApacheKafka(t testing.TB, opts ApacheKafkaOptions) *ApacheKafka {
	t.Helper()
	k, err := SharedApacheKafka(opts)
	if err == nil {
		return k
	}
	if errors.Is(err, ErrApacheKafkaUnavailable) {
		msg := fmt.Sprintf("Apache Kafka could not be started: %v\n"+
			"to fix: install Maven and Java 17+, then run test/kafka/fetch.sh", err)
		if os.Getenv(RequireApacheKafkaEnv) == "1" {
			t.Fatalf("%s\n(%s=1: unavailable Apache Kafka fails the test)", msg, RequireApacheKafkaEnv)
		}
		t.Skipf("SKIPPING: %s\n(set %s=1 to make this a failure instead of a skip)", msg, RequireApacheKafkaEnv)
	}
	t.Fatalf("Apache Kafka could not be started: %v", err)
	return nil
}
