package publisher

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"time"

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
// where a read_committed consumer starting at the group's committed offset
// would still be handed a record below the partition's last stable offset:
// the end a read_committed consumer reaches, so an exactly-once relay's
// open transaction (which holds that end back) never counts as read.
// Nothing behind means every group has read everything written.
//
// A committed offset below the end is not enough to count a group behind:
// on a topic written in Kafka transactions each transaction ends with a
// commit or abort marker, a control record that takes an offset and that
// no consumer is handed. A consumer that commits the offset after the last
// record it was handed (franz-go's CommitUncommittedOffsets, librdkafka's
// stored offsets) stops one short of the end, on the marker, for ever once
// the relay is stopped; so do the records of an aborted transaction.
// Only the records between the two offsets say whether the group has read
// everything, so those are read (unreadRecord).
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
	// Groups at the same offset share one read.
	type probe struct {
		partition int32
		from      int64
	}
	probed := map[probe]bool{}
	var behind []GroupBehind
	for _, g := range groups {
		resp, err := admin.ListConsumerGroupOffsets(g, map[string][]int32{topic: parts})
		if errors.Is(err, sarama.ErrGroupIDNotFound) || (err == nil && errors.Is(resp.Err, sarama.ErrGroupIDNotFound)) {
			// A group that never committed: some brokers answer so (sarama
			// returns the group's error as the call's), others with no
			// offsets; either way it read nothing.
			resp, err = &sarama.OffsetFetchResponse{}, nil
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
			if ends[p] <= 0 || committed >= ends[p] {
				continue
			}
			if committed >= 0 {
				k := probe{p, committed}
				unread, ok := probed[k]
				if !ok {
					if unread, err = unreadRecord(client, topic, p, committed, ends[p]); err != nil {
						return nil, err
					}
					probed[k] = unread
				}
				if !unread {
					continue
				}
			}
			behind = append(behind, GroupBehind{Group: g, Partition: p, Committed: committed, End: ends[p]})
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
	var end int64
	err := withLeader(client, topic, partition, func(broker *sarama.Broker) error {
		req := sarama.NewOffsetRequest(client.Config().Version)
		req.IsolationLevel = sarama.ReadCommitted
		req.AddBlock(topic, partition, sarama.OffsetNewest, 1)
		resp, err := broker.GetAvailableOffsets(req)
		if err != nil {
			return err
		}
		block := resp.GetBlock(topic, partition)
		if block == nil {
			return sarama.ErrIncompleteResponse
		}
		if !errors.Is(block.Err, sarama.ErrNoError) {
			return block.Err
		}
		end = block.Offset
		if len(block.Offsets) > 0 {
			end = block.Offsets[0]
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("read the end of %s/%d: %w", topic, partition, err)
	}
	return end, nil
}

// leaderRetryFor bounds how long withLeader tries again.
const leaderRetryFor = 30 * time.Second

// withLeader runs fn with the partition's leader, and again, with the
// metadata refreshed, while it fails in a way that passes: right after
// partitions were added, or a leader moved, the brokers answer
// NOT_LEADER_OR_FOLLOWER, LEADER_NOT_AVAILABLE or OFFSET_NOT_AVAILABLE for
// a few seconds.
func withLeader(client sarama.Client, topic string, partition int32, fn func(*sarama.Broker) error) error {
	deadline := time.Now().Add(leaderRetryFor)
	backoff := 100 * time.Millisecond
	for {
		broker, err := client.Leader(topic, partition)
		if err == nil {
			if err = fn(broker); err == nil {
				return nil
			}
		}
		if !leaderRetriable(err) || time.Now().Add(backoff).After(deadline) {
			return err
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, 2*time.Second)
		// A failed refresh shows as the next attempt's error.
		_ = client.RefreshMetadata(topic)
	}
}

// leaderRetriable says whether a partition request's error passes with
// fresh metadata or a little time.
func leaderRetriable(err error) bool {
	for _, k := range []sarama.KError{
		sarama.ErrNotLeaderForPartition, sarama.ErrLeaderNotAvailable, sarama.ErrOffsetNotAvailable,
		sarama.ErrUnknownLeaderEpoch, sarama.ErrFencedLeaderEpoch, sarama.ErrReplicaNotAvailable,
		sarama.ErrUnknownTopicOrPartition, sarama.ErrRequestTimedOut, sarama.ErrNotEnoughReplicas,
	} {
		if errors.Is(err, k) {
			return true
		}
	}
	var kerr sarama.KError
	if errors.As(err, &kerr) {
		return false
	}
	// Network errors: a broker restarting, a connection closed.
	return err != nil && !errors.Is(err, sarama.ErrIncompleteResponse)
}

// unreadRecord says whether a read_committed consumer that starts at from
// on a partition would be handed a record below end: it fetches the
// records in between, read_committed, and skips what such a consumer
// skips, control records (the markers that end transactions) and the
// records of aborted transactions, as sarama's own consumer does. A
// committed offset the partition no longer holds (deleted by retention)
// counts as unread: the group has not read what was there.
func unreadRecord(client sarama.Client, topic string, partition int32, from, end int64) (bool, error) {
	version := fetchVersion(client.Config().Version)
	maxBytes := int32(1 << 20)
	// aborted holds the producers whose aborted transaction the read is
	// inside: their transactional records are skipped until their abort
	// marker.
	aborted := map[int64]bool{}
	for offset := from; offset < end; {
		var block *sarama.FetchResponseBlock
		err := withLeader(client, topic, partition, func(broker *sarama.Broker) error {
			req := &sarama.FetchRequest{Version: version, MaxWaitTime: 0, MinBytes: 1, MaxBytes: maxBytes, Isolation: sarama.ReadCommitted}
			if version >= 7 {
				req.SessionID, req.SessionEpoch = 0, -1
			}
			req.AddBlock(topic, partition, offset, maxBytes, -1)
			resp, err := broker.Fetch(req)
			if err != nil {
				return err
			}
			if block = resp.GetBlock(topic, partition); block == nil {
				return sarama.ErrIncompleteResponse
			}
			if !errors.Is(block.Err, sarama.ErrNoError) {
				return block.Err
			}
			return nil
		})
		if errors.Is(err, sarama.ErrOffsetOutOfRange) {
			return true, nil
		}
		if err != nil {
			return false, fmt.Errorf("read %s/%d from offset %d: %w", topic, partition, offset, err)
		}
		txns := append([]*sarama.AbortedTransaction(nil), block.AbortedTransactions...)
		sort.Slice(txns, func(i, j int) bool { return txns[i].FirstOffset < txns[j].FirstOffset })
		next := offset
		for _, set := range block.RecordsSet {
			if set.MsgSet != nil {
				// The old message format has no transactions: every
				// message is a record.
				for _, m := range set.MsgSet.Messages {
					if m.Offset >= next && m.Offset < end {
						return true, nil
					}
				}
				break
			}
			batch := set.RecordBatch
			if batch == nil || batch.PartialTrailingRecord {
				break
			}
			for len(txns) > 0 && txns[0].FirstOffset <= batch.LastOffset() {
				aborted[txns[0].ProducerID] = true
				txns = txns[1:]
			}
			last := batch.LastOffset()
			switch {
			case last < next:
			case batch.Control:
				if len(batch.Records) > 0 && controlType(batch.Records[0].Key) == sarama.ControlRecordAbort {
					delete(aborted, batch.ProducerID)
				}
			case batch.IsTransactional && aborted[batch.ProducerID]:
			default:
				for _, r := range batch.Records {
					if o := batch.FirstOffset + r.OffsetDelta; o >= next && o < end {
						return true, nil
					}
				}
			}
			next = max(next, last+1)
		}
		if next > offset {
			offset = next
			continue
		}
		// Nothing whole came back: a batch larger than maxBytes (a broker
		// before KIP-74), or nothing at all below the end.
		if !block.Partial || maxBytes >= 1<<30 {
			return false, fmt.Errorf("read %s/%d from offset %d: no record came back below its end %d", topic, partition, offset, end)
		}
		maxBytes *= 4
	}
	return false, nil
}

// controlType is a control record's type, from its key: a version, then
// the type, both int16.
func controlType(key []byte) sarama.ControlRecordType {
	if len(key) < 4 {
		return sarama.ControlRecordUnknown
	}
	switch binary.BigEndian.Uint16(key[2:4]) {
	case 0:
		return sarama.ControlRecordAbort
	case 1:
		return sarama.ControlRecordCommit
	default:
		return sarama.ControlRecordUnknown
	}
}

// fetchVersion is the Fetch request version sarama's consumer uses for
// the brokers' version; 4 and later carry the isolation level, and the
// relay needs 0.11 or newer.
func fetchVersion(v sarama.KafkaVersion) int16 {
	switch {
	case v.IsAtLeast(sarama.V2_7_0_0):
		return 12
	case v.IsAtLeast(sarama.V2_3_0_0):
		return 11
	case v.IsAtLeast(sarama.V2_1_0_0):
		return 10
	case v.IsAtLeast(sarama.V2_0_0_0):
		return 8
	case v.IsAtLeast(sarama.V1_1_0_0):
		return 7
	case v.IsAtLeast(sarama.V1_0_0_0):
		return 6
	default:
		return 5
	}
}
