package publisher

import (
	"errors"
	"fmt"
	"sort"

	"github.com/IBM/sarama"
)

// TopicPartitionCount is an event topic's partition count as the brokers
// report it now, for partitions show and adopt.
func TopicPartitionCount(client sarama.Client, topic string) (int32, error) {
	if err := client.RefreshMetadata(topic); err != nil {
		return 0, fmt.Errorf("look up topic %s: %w", topic, err)
	}
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, fmt.Errorf("look up topic %s: %w", topic, err)
	}
	return int32(len(parts)), nil
}

// GroupBehind is a consumer group that has not read a partition of the
// topic to its end.
type GroupBehind struct {
	Group     string
	Partition int32
	Committed int64 // -1: nothing committed
	End       int64 // the last stable offset
}

// GroupsBehind returns, for every group and every partition of topic,
// where the group's committed offset is below the partition's last stable
// offset: the end a read_committed consumer reaches, so an exactly-once
// relay's open transaction (which holds that end back) never counts as
// read. Nothing behind means every group has read everything written.
func GroupsBehind(client sarama.Client, admin sarama.ClusterAdmin, topic string, groups []string) ([]GroupBehind, error) {
	parts, err := client.Partitions(topic)
	if err != nil {
		return nil, fmt.Errorf("look up topic %s: %w", topic, err)
	}
	ends := make(map[int32]int64, len(parts))
	for _, p := range parts {
		end, err := lastStableOffset(client, topic, p)
		if err != nil {
			return nil, err
		}
		ends[p] = end
	}
	var behind []GroupBehind
	for _, g := range groups {
		resp, err := admin.ListConsumerGroupOffsets(g, map[string][]int32{topic: parts})
		if err == nil && errors.Is(resp.Err, sarama.ErrGroupIDNotFound) {
			// A group that never committed: some brokers answer so, others
			// with no offsets; either way it read nothing.
			resp = &sarama.OffsetFetchResponse{}
		} else if err == nil && !errors.Is(resp.Err, sarama.ErrNoError) {
			err = resp.Err
		}
		if err != nil {
			return nil, fmt.Errorf("read the committed offsets of consumer group %s: %w", g, err)
		}
		for _, p := range parts {
			committed := int64(-1)
			if b := resp.GetBlock(topic, p); b != nil {
				if !errors.Is(b.Err, sarama.ErrNoError) {
					return nil, fmt.Errorf("read consumer group %s's offset of %s/%d: %w", g, topic, p, b.Err)
				}
				committed = b.Offset
			}
			if ends[p] > 0 && committed < ends[p] {
				behind = append(behind, GroupBehind{Group: g, Partition: p, Committed: committed, End: ends[p]})
			}
		}
	}
	sort.Slice(behind, func(i, j int) bool {
		if behind[i].Group != behind[j].Group {
			return behind[i].Group < behind[j].Group
		}
		return behind[i].Partition < behind[j].Partition
	})
	return behind, nil
}

// lastStableOffset asks a partition's leader for its end as a
// read_committed consumer sees it.
func lastStableOffset(client sarama.Client, topic string, partition int32) (int64, error) {
	broker, err := client.Leader(topic, partition)
	if err != nil {
		return 0, fmt.Errorf("find the leader of %s/%d: %w", topic, partition, err)
	}
	req := sarama.NewOffsetRequest(client.Config().Version)
	req.IsolationLevel = sarama.ReadCommitted
	req.AddBlock(topic, partition, sarama.OffsetNewest, 1)
	resp, err := broker.GetAvailableOffsets(req)
	if err != nil {
		return 0, fmt.Errorf("read the end of %s/%d: %w", topic, partition, err)
	}
	block := resp.GetBlock(topic, partition)
	if block == nil {
		return 0, fmt.Errorf("read the end of %s/%d: %w", topic, partition, sarama.ErrIncompleteResponse)
	}
	if !errors.Is(block.Err, sarama.ErrNoError) {
		return 0, fmt.Errorf("read the end of %s/%d: %w", topic, partition, block.Err)
	}
	if len(block.Offsets) > 0 {
		return block.Offsets[0], nil
	}
	return block.Offset, nil
}
