package publisher

import (
	"fmt"

	"github.com/IBM/sarama"
)

// murmur2 is Kafka's hash for keyed records, a port of the Java client's
// org.apache.kafka.common.utils.Utils.murmur2. Placing keys exactly as the
// Java client (and so Debezium, Kafka Streams and ksqlDB) does lets a team
// move between those tools and this relay without an aggregate changing
// partition.
func murmur2(data []byte) int32 {
	const (
		seed uint32 = 0x9747b28c
		m    uint32 = 0x5bd1e995
		r           = 24
	)
	length := len(data)
	h := seed ^ uint32(length)
	fours := length / 4
	for i := 0; i < fours; i++ {
		k := uint32(data[4*i]) | uint32(data[4*i+1])<<8 | uint32(data[4*i+2])<<16 | uint32(data[4*i+3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	tail := data[fours*4:]
	switch len(tail) {
	case 3:
		h ^= uint32(tail[2]) << 16
		fallthrough
	case 2:
		h ^= uint32(tail[1]) << 8
		fallthrough
	case 1:
		h ^= uint32(tail[0])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return int32(h)
}

// JavaPartition returns the partition the Java client's default partitioner
// picks for a keyed record: toPositive(murmur2(key)) % numPartitions.
func JavaPartition(key []byte, numPartitions int32) int32 {
	return (murmur2(key) & 0x7fffffff) % numPartitions
}

// javaPartitioner is a sarama.Partitioner that places keys like the Java
// client. sarama's own hash partitioners use FNV-1a and would scatter
// aggregates differently.
type javaPartitioner struct{}

func newJavaPartitioner(string) sarama.Partitioner { return javaPartitioner{} }

func (j javaPartitioner) Partition(msg *sarama.ProducerMessage, numPartitions int32) (int32, error) {
	return j.partitionBy(msg, numPartitions)
}

// partitionBy places msg's key among numPartitions partitions.
func (javaPartitioner) partitionBy(msg *sarama.ProducerMessage, numPartitions int32) (int32, error) {
	if msg.Key == nil {
		return 0, fmt.Errorf("partition record for topic %s: record has no key", msg.Topic)
	}
	key, err := msg.Key.Encode()
	if err != nil {
		return 0, fmt.Errorf("partition record for topic %s: encode key: %w", msg.Topic, err)
	}
	return JavaPartition(key, numPartitions), nil
}

// RequiresConsistency is true: a key must land on its partition even while
// that partition is unavailable, or per-aggregate order breaks.
func (javaPartitioner) RequiresConsistency() bool { return true }
