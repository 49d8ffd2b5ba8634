package publisher

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/outbox-relay/outbox-relay/progress"
)

// progressSegmentBytes is the progress topic's segment size: about 70,000 records.
const progressSegmentBytes = 10 << 20

// progressPartition is the one partition progress lives on: one ordered log, so the
// last record of a key is the newest.
const progressPartition = 0

// ProgressStore is the progress topic on one Kafka cluster: it reads and writes
// records through a client of its own.
type ProgressStore struct {
	topic    string
	brokers  []string
	client   sarama.Client
	admin    sarama.ClusterAdmin
	producer sarama.SyncProducer

	// A write that starts after Close would send on the producer's closed
	// input and panic: a progress writer that gave up waiting for a
	// stalled broker still flushes once more when it stops.
	mu      sync.Mutex
	closed  bool
	writing sync.WaitGroup
}

// ErrProgressClosed is the error of a write to a closed progress store.
var ErrProgressClosed = errors.New("progress store closed")

// closeWait bounds how long Close waits for writes under way, which a
// stalled broker can hold for the producer's whole timeout.
const closeWait = 5 * time.Second

// OpenProgress connects to Kafka with sc (see publisher.ClientConfig) and makes
// sure the topic exists, creating it compacted with one partition when it
// does not. Metadata lookups never create topics here: a broker with
// auto-creation would make it with its default partitions and policy.
func OpenProgress(ctx context.Context, brokers []string, sc *sarama.Config, topic string) (*ProgressStore, error) {
	return openProgress(ctx, brokers, sc, topic, true)
}

// OpenExistingProgress is OpenProgress for readers that must change nothing: a missing
// topic is progress.ErrTopic.
func OpenExistingProgress(ctx context.Context, brokers []string, sc *sarama.Config, topic string) (*ProgressStore, error) {
	return openProgress(ctx, brokers, sc, topic, false)
}

func openProgress(ctx context.Context, brokers []string, sc *sarama.Config, topic string, create bool) (*ProgressStore, error) {
	if topic == "" {
		return nil, fmt.Errorf("%w: --progress-topic is empty", progress.ErrTopic)
	}
	conf := *sc
	conf.Metadata.AllowAutoTopicCreation = false
	conf.Producer.RequiredAcks = sarama.WaitForAll
	conf.Producer.Return.Successes = true
	conf.Producer.Return.Errors = true
	conf.Producer.Partitioner = sarama.NewManualPartitioner
	conf.Producer.Retry.Max = 5
	conf.Producer.Idempotent = false
	conf.Net.MaxOpenRequests = 5
	conf.Producer.Transaction.ID = ""
	client, err := sarama.NewClient(brokers, &conf)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", progress.ErrConnect, err)
	}
	s := &ProgressStore{topic: topic, brokers: brokers, client: client}
	if s.admin, err = sarama.NewClusterAdminFromClient(client); err != nil {
		client.Close()
		return nil, fmt.Errorf("progress: create kafka admin client: %w", err)
	}
	if _, err := s.ensureTopic(ctx, create); err != nil {
		s.admin.Close()
		return nil, err
	}
	if s.producer, err = sarama.NewSyncProducerFromClient(client); err != nil {
		s.admin.Close()
		return nil, fmt.Errorf("progress: create kafka producer: %w", err)
	}
	return s, nil
}

// Topic is the progress topic's name.
func (s *ProgressStore) Topic() string { return s.topic }

// Close releases the store's Kafka connections.
func (s *ProgressStore) Close() error {
	s.mu.Lock()
	was := s.closed
	s.closed = true
	s.mu.Unlock()
	if was {
		return nil
	}
	done := make(chan struct{})
	go func() {
		s.writing.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(closeWait):
	}
	perr := s.producer.Close()
	if err := s.admin.Close(); err != nil && !errors.Is(err, sarama.ErrClosedClient) {
		return err
	}
	return perr
}

// Recreate makes the topic again after a read found it missing (see
// progress.ErrTopicMissing), as OpenProgress would, and waits for its leader. created is
// false when the topic existed after all: a broker that had just restarted
// did not know it yet.
func (s *ProgressStore) Recreate(ctx context.Context) (created bool, err error) {
	return s.ensureTopic(ctx, true)
}

// ensureTopic creates the topic when it is missing. A missing topic the
// brokers refuse to create is progress.ErrTopic, with the command that creates it.
func (s *ProgressStore) ensureTopic(ctx context.Context, create bool) (created bool, err error) {
	meta, err := s.admin.DescribeTopics([]string{s.topic})
	if err != nil {
		return false, fmt.Errorf("progress: describe topic %s: %w", s.topic, err)
	}
	exists := len(meta) == 1 && errors.Is(meta[0].Err, sarama.ErrNoError)
	if !exists && len(meta) == 1 && !errors.Is(meta[0].Err, sarama.ErrUnknownTopicOrPartition) {
		if errors.Is(meta[0].Err, sarama.ErrTopicAuthorizationFailed) {
			return false, fmt.Errorf("%w: %s: kafka refused to describe it (%v): grant the relay's user Describe, Read and Write on it: %s",
				progress.ErrTopic, s.topic, meta[0].Err, s.aclCommand())
		}
		return false, fmt.Errorf("progress: describe topic %s: %w", s.topic, meta[0].Err)
	}
	if !exists && !create {
		return false, fmt.Errorf("%w: %s does not exist (a relay creates it on its first run)", progress.ErrTopic, s.topic)
	}
	if !exists {
		if created, err = s.createTopic(); err != nil {
			return false, err
		}
	} else if err := s.checkLayout(meta[0]); err != nil {
		return false, err
	}
	return created, s.awaitLeader(ctx)
}

// createTopic creates the topic; created is false when a describe that
// lagged behind the controller called it missing and it existed.
func (s *ProgressStore) createTopic() (created bool, err error) {
	detail := &sarama.TopicDetail{
		NumPartitions:     1,
		ReplicationFactor: s.replicationFactor(),
		// Small segments let compaction drop old records soon, so the read
		// at each start stays short: the active segment is never compacted.
		ConfigEntries: map[string]*string{"cleanup.policy": ptr("compact"), "segment.bytes": ptr(strconv.Itoa(progressSegmentBytes))},
	}
	err = s.admin.CreateTopic(s.topic, detail, false)
	if err == nil || errors.Is(err, sarama.ErrTopicAlreadyExists) {
		return err == nil, nil
	}
	return false, fmt.Errorf("%w: %s does not exist and kafka refused to create it (%v): create it with\n  %s\nor grant the relay's user Create on it: %s",
		progress.ErrTopic, s.topic, err, s.CreateCommand(), s.aclCommand())
}

// replicationFactor is min(3, brokers): durable where the cluster allows,
// and still creatable on a one-broker test cluster.
func (s *ProgressStore) replicationFactor() int16 {
	return int16(min(3, max(1, len(s.client.Brokers()))))
}

// CreateCommand is the kafka-topics.sh command an operator runs to create
// the topic the way the relay would.
func (s *ProgressStore) CreateCommand() string {
	return fmt.Sprintf("kafka-topics.sh --bootstrap-server %s --create --topic %s --partitions 1 --replication-factor %d --config cleanup.policy=compact --config segment.bytes=%d",
		strings.Join(s.brokers, ","), s.topic, s.replicationFactor(), progressSegmentBytes)
}

func (s *ProgressStore) aclCommand() string {
	return fmt.Sprintf("kafka-acls.sh --bootstrap-server %s --add --allow-principal User:<relay user> --operation Create --operation Describe --operation Read --operation Write --topic %s",
		strings.Join(s.brokers, ","), s.topic)
}

// awaitLeader waits until the partition has a leader: a topic just created
// takes a moment to get one.
func (s *ProgressStore) awaitLeader(ctx context.Context) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		err := s.client.RefreshMetadata(s.topic)
		if err == nil {
			if _, err = s.client.Leader(s.topic, progressPartition); err == nil {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("progress: topic %s has no leader for progressPartition %d: %w (last error: %v)", s.topic, progressPartition, ctx.Err(), err)
		case <-tick.C:
		}
	}
}

// Write stores a record for key and returns once Kafka acknowledged it.
func (s *ProgressStore) Write(key []byte, r progress.Record) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return fmt.Errorf("write progress to %s: %w", s.topic, ErrProgressClosed)
	}
	s.writing.Add(1)
	s.mu.Unlock()
	defer s.writing.Done()
	_, _, err := s.producer.SendMessage(&sarama.ProducerMessage{
		Topic: s.topic, Partition: progressPartition, Key: sarama.ByteEncoder(key), Value: sarama.ByteEncoder(r.Marshal()),
	})
	if errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		return fmt.Errorf("write progress to %s: %w: %w", s.topic, progress.ErrTopicMissing, err)
	}
	if err != nil {
		return fmt.Errorf("write progress to %s: %w", s.topic, err)
	}
	return nil
}

func ptr[T any](v T) *T { return &v }
