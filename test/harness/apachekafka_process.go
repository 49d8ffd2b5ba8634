package harness

// Apache Kafka process lifecycle: starting a cluster, launching,
// stopping, killing and restarting node JVMs, their logs, and Close.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/internal/throwaway"
)

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
	dir, err := throwaway.MakeOwnedTempDir("outbox-relay-kafka-" + opts.Version + "-")
	if err != nil {
		return nil, err
	}
	k := &ApacheKafka{opts: opts, java: java, libs: libs, dir: dir}
	// Main closes whatever the tests left running (also on SIGINT/SIGTERM).
	k.unregister = local.OnClose(k.Close)
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
	perNode := 2
	if k.opts.Proxied {
		perNode = 3
	}
	ports, err := freePorts(perNode * k.opts.Nodes)
	if err != nil {
		return err
	}
	for i := range k.opts.Nodes {
		n := &kafkaNode{
			id:             i,
			brokerPort:     ports[perNode*i],
			controllerPort: ports[perNode*i+1],
			dir:            filepath.Join(k.dir, fmt.Sprintf("node-%d", i)),
		}
		if k.opts.Proxied {
			n.externalPort = ports[perNode*i+2]
			if n.toxi, err = newToxi(fmt.Sprintf("127.0.0.1:%d", n.externalPort)); err != nil {
				return err
			}
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
		kgo.SeedBrokers(k.DirectBrokers()...),
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
		for _, n := range k.nodes {
			if n.toxi != nil {
				n.toxi.stop()
			}
		}
		if !k.keepDir {
			_ = os.RemoveAll(k.dir)
		}
	})
}
