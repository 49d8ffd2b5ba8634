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
// The files: apachekafka.go holds the options, the cluster type and the
// per-package sharing; apachekafka_config.go writes node configuration and
// formats storage; apachekafka_process.go starts, stops and kills the JVMs
// (Linux-only in practice: process groups and SysProcAttr.Pdeathsig);
// apachekafka_admin.go waits for readiness and creates topics.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
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
	// Proxied puts toxiproxy in front of every broker (Toxi): clients
	// reach a broker only through it, since its listener for clients
	// advertises the proxy's address. Brokers talk to each other directly.
	Proxied bool
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
	fmt.Fprintf(&b, "v=%s n=%d isr=%d rf=%d auto=%t parts=%d heap=%d server=%t timeout=%s proxied=%t",
		o.Version, o.Nodes, o.MinInsyncReplicas, o.DefaultReplicationFactor,
		o.AutoCreateTopics, o.NumPartitions, o.HeapMB, o.ServerJVM, o.StartTimeout, o.Proxied)
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
	// externalPort is the clients' listener of a proxied cluster, behind
	// toxi; 0 without a proxy.
	externalPort int
	toxi         *Toxi
	dir          string
	props        string
	logPath      string

	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has exited
	err  error         // cmd.Wait result, set before done is closed
}

// Brokers returns the brokers' host:port addresses, indexed by node: the
// proxies' of a proxied cluster.
func (k *ApacheKafka) Brokers() []string {
	out := make([]string, len(k.nodes))
	for i, n := range k.nodes {
		if n.toxi != nil {
			out[i] = n.toxi.Addr()
		} else {
			out[i] = fmt.Sprintf("127.0.0.1:%d", n.brokerPort)
		}
	}
	return out
}

// DirectBrokers are the brokers' own addresses, past any proxy: the
// harness's admin client, and a test's producer, keep working while a test
// breaks the proxies.
func (k *ApacheKafka) DirectBrokers() []string {
	out := make([]string, len(k.nodes))
	for i, n := range k.nodes {
		out[i] = fmt.Sprintf("127.0.0.1:%d", n.brokerPort)
	}
	return out
}

// Toxi is the proxy in front of node i of a proxied cluster (nil
// otherwise). A test that adds faults must Heal them before it ends: the
// cluster is shared.
func (k *ApacheKafka) Toxi(i int) *Toxi { return k.nodes[i].toxi }

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
