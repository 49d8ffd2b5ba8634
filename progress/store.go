package progress

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/IBM/sarama"
)

// ErrTopic marks a progress topic that is missing and that the relay may not
// create, or that cannot be used. Retrying cannot fix it: the operator must
// create the topic or grant the right.
var ErrTopic = errors.New("progress topic unusable")

// segmentBytes is the progress topic's segment size: about 70,000 records.
const segmentBytes = 10 << 20

// ErrTopicMissing marks a read of a progress topic that the brokers do not
// have (any more): deleted, or lost with a broker's data. Recreate makes it
// again.
var ErrTopicMissing = errors.New("progress topic missing on the brokers")

// ErrConnect marks a failure to connect to the brokers; the error also
// wraps sarama's, for the caller to explain (credentials, certificates).
var ErrConnect = errors.New("progress: cannot connect to kafka")

// partition is the one partition progress lives on: one ordered log, so the
// last record of a key is the newest.
const partition = 0

// Store is the progress topic on one Kafka cluster: it reads and writes
// records through a client of its own.
type Store struct {
	topic    string
	brokers  []string
	client   sarama.Client
	admin    sarama.ClusterAdmin
	producer sarama.SyncProducer
}

// Open connects to Kafka with sc (see publisher.ClientConfig) and makes
// sure the topic exists, creating it compacted with one partition when it
// does not. Metadata lookups never create topics here: a broker with
// auto-creation would make it with its default partitions and policy.
func Open(ctx context.Context, brokers []string, sc *sarama.Config, topic string) (*Store, error) {
	return open(ctx, brokers, sc, topic, true)
}

// OpenExisting is Open for readers that must change nothing: a missing
// topic is ErrTopic.
func OpenExisting(ctx context.Context, brokers []string, sc *sarama.Config, topic string) (*Store, error) {
	return open(ctx, brokers, sc, topic, false)
}

func open(ctx context.Context, brokers []string, sc *sarama.Config, topic string, create bool) (*Store, error) {
	if topic == "" {
		return nil, fmt.Errorf("%w: --progress-topic is empty", ErrTopic)
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
		return nil, fmt.Errorf("%w: %w", ErrConnect, err)
	}
	s := &Store{topic: topic, brokers: brokers, client: client}
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
func (s *Store) Topic() string { return s.topic }

// Close releases the store's Kafka connections.
func (s *Store) Close() error {
	perr := s.producer.Close()
	if err := s.admin.Close(); err != nil && !errors.Is(err, sarama.ErrClosedClient) {
		return err
	}
	return perr
}

// Recreate makes the topic again after a read found it missing (see
// ErrTopicMissing), as Open would, and waits for its leader. created is
// false when the topic existed after all: a broker that had just restarted
// did not know it yet.
func (s *Store) Recreate(ctx context.Context) (created bool, err error) {
	return s.ensureTopic(ctx, true)
}

// ensureTopic creates the topic when it is missing. A missing topic the
// brokers refuse to create is ErrTopic, with the command that creates it.
func (s *Store) ensureTopic(ctx context.Context, create bool) (created bool, err error) {
	meta, err := s.admin.DescribeTopics([]string{s.topic})
	if err != nil {
		return false, fmt.Errorf("progress: describe topic %s: %w", s.topic, err)
	}
	exists := len(meta) == 1 && errors.Is(meta[0].Err, sarama.ErrNoError)
	if !exists && len(meta) == 1 && !errors.Is(meta[0].Err, sarama.ErrUnknownTopicOrPartition) {
		if errors.Is(meta[0].Err, sarama.ErrTopicAuthorizationFailed) {
			return false, fmt.Errorf("%w: %s: kafka refused to describe it (%v): grant the relay's user Describe, Read and Write on it: %s",
				ErrTopic, s.topic, meta[0].Err, s.aclCommand())
		}
		return false, fmt.Errorf("progress: describe topic %s: %w", s.topic, meta[0].Err)
	}
	if !exists && !create {
		return false, fmt.Errorf("%w: %s does not exist (a relay creates it on its first run)", ErrTopic, s.topic)
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
func (s *Store) createTopic() (created bool, err error) {
	detail := &sarama.TopicDetail{
		NumPartitions:     1,
		ReplicationFactor: s.replicationFactor(),
		// Small segments let compaction drop old records soon, so the read
		// at each start stays short: the active segment is never compacted.
		ConfigEntries: map[string]*string{"cleanup.policy": ptr("compact"), "segment.bytes": ptr(strconv.Itoa(segmentBytes))},
	}
	err = s.admin.CreateTopic(s.topic, detail, false)
	if err == nil || errors.Is(err, sarama.ErrTopicAlreadyExists) {
		return err == nil, nil
	}
	return false, fmt.Errorf("%w: %s does not exist and kafka refused to create it (%v): create it with\n  %s\nor grant the relay's user Create on it: %s",
		ErrTopic, s.topic, err, s.CreateCommand(), s.aclCommand())
}

// replicationFactor is min(3, brokers): durable where the cluster allows,
// and still creatable on a one-broker test cluster.
func (s *Store) replicationFactor() int16 {
	return int16(min(3, max(1, len(s.client.Brokers()))))
}

// CreateCommand is the kafka-topics.sh command an operator runs to create
// the topic the way the relay would.
func (s *Store) CreateCommand() string {
	return fmt.Sprintf("kafka-topics.sh --bootstrap-server %s --create --topic %s --partitions 1 --replication-factor %d --config cleanup.policy=compact --config segment.bytes=%d",
		strings.Join(s.brokers, ","), s.topic, s.replicationFactor(), segmentBytes)
}

func (s *Store) aclCommand() string {
	return fmt.Sprintf("kafka-acls.sh --bootstrap-server %s --add --allow-principal User:<relay user> --operation Create --operation Describe --operation Read --operation Write --topic %s",
		strings.Join(s.brokers, ","), s.topic)
}

// awaitLeader waits until the partition has a leader: a topic just created
// takes a moment to get one.
func (s *Store) awaitLeader(ctx context.Context) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		err := s.client.RefreshMetadata(s.topic)
		if err == nil {
			if _, err = s.client.Leader(s.topic, partition); err == nil {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("progress: topic %s has no leader for partition %d: %w (last error: %v)", s.topic, partition, ctx.Err(), err)
		case <-tick.C:
		}
	}
}

// Write stores a record for key and returns once Kafka acknowledged it.
func (s *Store) Write(key []byte, r Record) error {
	_, _, err := s.producer.SendMessage(&sarama.ProducerMessage{
		Topic: s.topic, Partition: partition, Key: sarama.ByteEncoder(key), Value: sarama.ByteEncoder(r.Marshal()),
	})
	if err != nil {
		return fmt.Errorf("write progress to %s: %w", s.topic, err)
	}
	return nil
}

func ptr[T any](v T) *T { return &v }
