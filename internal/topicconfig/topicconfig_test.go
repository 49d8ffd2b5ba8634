package topicconfig

import (
	"errors"
	"testing"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
)

func admin(t *testing.T) sarama.ClusterAdmin {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	adm, err := sarama.NewClusterAdmin(c.ListenAddrs(), sc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { adm.Close() })
	return adm
}

// The value set on the topic is read back by name, and a topic the broker
// does not know fails with an error that unwraps to the broker's code, as
// the deprecated ClusterAdmin.DescribeConfig did: the progress store tells
// a refused describe from other failures that way.
func TestValueReadsTheTopicsSettingAndUnwrapsRefusals(t *testing.T) {
	adm := admin(t)
	maxBytes, policy := "4000", "compact"
	if err := adm.CreateTopic("t", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1, ConfigEntries: map[string]*string{
		"max.message.bytes": &maxBytes, "cleanup.policy": &policy,
	}}, false); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"max.message.bytes": "4000", "cleanup.policy": "compact"} {
		got, found, err := Value(adm, "t", name)
		if err != nil || !found || got != want {
			t.Errorf("Value(t, %s) = %q, %v, %v; want %q, true, nil", name, got, found, err, want)
		}
	}

	_, found, err := Value(adm, "missing", "cleanup.policy")
	var described *sarama.DescribeConfigError
	if found || !errors.As(err, &described) || !errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		t.Fatalf("Value(missing) = found %v, err %v (%T); want a *sarama.DescribeConfigError unwrapping to UNKNOWN_TOPIC_OR_PARTITION", found, err, err)
	}
}
