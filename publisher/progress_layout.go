package publisher

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/internal/topicconfig"
	"github.com/outbox-relay/outbox-relay/progress"
)

// checkLayout refuses an existing progress topic that is not what the
// relay would have created. With more than one partition the newest record
// of a key need not be the last one read; without compaction the record
// can be deleted by retention; and a topic that is neither was most likely
// meant for something else, such as events, whose consumers would then
// read progress records.
func (s *ProgressStore) checkLayout(meta *sarama.TopicMetadata) error {
	var problems []string
	if n := len(meta.Partitions); n != 1 {
		problems = append(problems, fmt.Sprintf("it has %d partitions, not 1", n))
	}
	policy, err := s.cleanupPolicy()
	if err != nil {
		return err
	}
	if !slices.Contains(strings.Split(policy, ","), "compact") {
		problems = append(problems, fmt.Sprintf("its cleanup.policy is %q, not compact", policy))
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s exists but %s, so it is not a progress topic the relay made: an event topic, or the relay's own progress topic deleted while it ran and made again by the brokers' auto.create.topics.enable with their defaults. "+
		"If it is an event topic, point --progress-topic at a topic of its own: a missing one is created as\n  %s\n"+
		"If it holds nothing but this relay's progress, delete it (kafka-topics.sh --delete --topic %s) and start the relay: it makes the topic again as above and starts from the slot, re-delivering what came after the slot's position (in exactly-once mode, read_committed consumers may see those twice); "+
		"turning off auto.create.topics.enable on the brokers keeps a deleted progress topic from coming back like this",
		progress.ErrTopic, s.topic, strings.Join(problems, " and "), s.CreateCommand(), s.topic)
}

// cleanupPolicy reads the topic's cleanup.policy.
func (s *ProgressStore) cleanupPolicy() (string, error) {
	policy, found, err := topicconfig.Value(s.admin, s.topic, "cleanup.policy")
	if errors.Is(err, sarama.ErrTopicAuthorizationFailed) || errors.Is(err, sarama.ErrClusterAuthorizationFailed) {
		return "", fmt.Errorf("%w: %s: kafka refused to describe its configuration (%v), which the relay checks at start: grant the relay's user DescribeConfigs on it: %s --operation DescribeConfigs",
			progress.ErrTopic, s.topic, err, s.aclCommand())
	}
	if err != nil {
		return "", fmt.Errorf("progress: describe configuration of topic %s: %w", s.topic, err)
	}
	if !found {
		return "delete", nil // Kafka's default when the broker reports none
	}
	return policy, nil
}
