package throwaway

import (
	"fmt"

	"github.com/twmb/franz-go/pkg/kfake"
)

// KfakeOptions configures StartKfake.
type KfakeOptions struct {
	// Brokers is the number of brokers; 0 means 1.
	Brokers int
	// Partitions is the partition count of auto-created topics and of
	// SeedTopics given 0 partitions; 0 keeps kfake's default of 10.
	Partitions int32
	// DisableAutoCreate turns off topic auto-creation, which is on by
	// default because producers (sarama included) rely on it.
	DisableAutoCreate bool
	// SeedTopics are created at start, name to partition count.
	SeedTopics map[string]int32
	// Extra are further kfake options, applied last.
	Extra []kfake.Opt
}

// StartKfake starts an in-process Kafka cluster (franz-go's kfake) on
// 127.0.0.1, configured by o; the caller closes it. It lives in the
// process, so nothing is left behind when the process dies.
func StartKfake(o KfakeOptions) (*kfake.Cluster, error) {
	brokers := o.Brokers
	if brokers <= 0 {
		brokers = 1
	}
	opts := []kfake.Opt{kfake.NumBrokers(brokers)}
	if !o.DisableAutoCreate {
		opts = append(opts, kfake.AllowAutoTopicCreation())
	}
	if o.Partitions > 0 {
		opts = append(opts, kfake.DefaultNumPartitions(int(o.Partitions)))
	}
	for topic, n := range o.SeedTopics {
		opts = append(opts, kfake.SeedTopics(n, topic))
	}
	opts = append(opts, o.Extra...)
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, fmt.Errorf("start kfake: %w", err)
	}
	return c, nil
}
