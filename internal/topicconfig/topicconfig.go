// Package topicconfig reads one configuration value of a Kafka topic. The
// publisher reads max.message.bytes to catch oversize records before they
// are sent, and the progress store reads cleanup.policy to refuse a topic
// that would delete its records.
package topicconfig

import (
	"github.com/IBM/sarama"
)

// Value returns the topic's value of the named configuration, and whether
// the broker reported one. A refusal for the topic comes back as a
// *sarama.DescribeConfigError, which unwraps to the broker's error code, so
// callers can test it with errors.Is (e.g. sarama.ErrTopicAuthorizationFailed).
func Value(admin sarama.ClusterAdmin, topic, name string) (string, bool, error) {
	results, err := admin.DescribeConfigs([]*sarama.ConfigResource{{
		Type: sarama.TopicResource, Name: topic, ConfigNames: []string{name},
	}}, sarama.DescribeConfigsOptions{})
	if err != nil {
		return "", false, err
	}
	for _, r := range results {
		if r.Name != topic {
			continue
		}
		if r.ErrorCode != sarama.ErrNoError {
			return "", false, &sarama.DescribeConfigError{Err: r.ErrorCode, ErrMsg: r.ErrorMsg}
		}
		for _, e := range r.Configs {
			if e.Name == name {
				return e.Value, true, nil
			}
		}
	}
	return "", false, nil
}
