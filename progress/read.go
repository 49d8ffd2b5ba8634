package progress

import (
	"context"
	"errors"
	"fmt"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/internal/kafkaread"
)

// Latest reads the partition from its start to the end that was stable when
// the read began and returns the last record for key. It reads committed
// data only (read_committed): records of aborted Kafka transactions are
// skipped, and the read stops at the last stable offset, so a record in a
// transaction still open never counts. found is false when no record for
// key exists. ctx bounds the whole read. A topic the brokers do not know is
// ErrTopicMissing.
//
// It reads with kafkaread rather than sarama's partition consumer, which
// hides control records: with transactions the last offset before the end
// is a commit marker, and a consumer waiting to see it would never return.
func (s *Store) Latest(ctx context.Context, key []byte) (rec Record, found bool, err error) {
	next, err := s.client.GetOffset(s.topic, partition, sarama.OffsetOldest)
	if errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		return Record{}, false, fmt.Errorf("read progress from %s: %w: %w", s.topic, ErrTopicMissing, err)
	}
	if err != nil {
		return Record{}, false, fmt.Errorf("read progress from %s: find the partition's start: %w", s.topic, err)
	}
	var value []byte
	p := kafkaread.Partition{Client: s.client, Topic: s.topic, Partition: partition}
	err = p.Read(ctx, next, kafkaread.StableEnd, func(r kafkaread.Record) {
		if string(r.Key) == string(key) {
			value = r.Value
		}
	})
	if err != nil {
		return Record{}, false, fmt.Errorf("read progress: %w", err)
	}
	if value == nil {
		return Record{}, false, nil
	}
	rec, err = Unmarshal(value)
	if err != nil {
		return Record{}, false, fmt.Errorf("%w: %s on %s: %w", ErrBadRecord, key, s.topic, err)
	}
	return rec, true, nil
}
