package harness

// Apache Kafka admin operations: waiting until the cluster and its
// partitions are ready, creating topics, and finding partition leaders and
// transaction coordinators.

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"
)

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

// TransactionCoordinator returns the index of the node coordinating the
// transactions of transactionalID, as a broker sees it now. A producer
// must have initialised with the id, or no coordinator holds it yet.
func (k *ApacheKafka) TransactionCoordinator(transactionalID string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req := kmsg.NewPtrFindCoordinatorRequest()
	req.CoordinatorType = 1 // transaction
	req.CoordinatorKey = transactionalID
	req.CoordinatorKeys = []string{transactionalID}
	resp, err := req.RequestWith(ctx, k.cl)
	if err != nil {
		return -1, fmt.Errorf("transaction coordinator: %w", err)
	}
	code, node := resp.ErrorCode, resp.NodeID
	if len(resp.Coordinators) > 0 {
		code, node = resp.Coordinators[0].ErrorCode, resp.Coordinators[0].NodeID
	}
	if err := kerr.ErrorForCode(code); err != nil {
		return -1, fmt.Errorf("transaction coordinator of %s: %w", transactionalID, err)
	}
	if node < 0 || int(node) >= len(k.nodes) {
		return -1, fmt.Errorf("transaction coordinator of %s: node %d is not in the cluster", transactionalID, node)
	}
	return int(node), nil
}
