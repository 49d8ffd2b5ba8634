package publisher

import (
	"context"
	"errors"
	"fmt"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/internal/kafkaread"
	"github.com/outbox-relay/outbox-relay/progress"
)

// Latest reads the partition from its start to the end that was stable when
// the read began and returns the last record for key. It reads committed
// data only (read_committed): records of aborted Kafka transactions are
// skipped, and the read stops at the last stable offset, so a record in a
// transaction still open never counts. found is false when no record for
// key exists. ctx bounds the whole read. A topic the brokers do not know is
// progress.ErrTopicMissing.
//
// It reads with kafkaread rather than sarama's partition consumer, which
// hides control records: with transactions the last offset before the end
// is a commit marker, and a consumer waiting to see it would never return.
func (s *ProgressStore) Latest(ctx context.Context, key []byte) (rec progress.Record, found bool, err error) {
	next, err := s.client.GetOffset(s.topic, progressPartition, sarama.OffsetOldest)
	if errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		return progress.Record{}, false, fmt.Errorf("read progress from %s: %w: %w", s.topic, progress.ErrTopicMissing, err)
	}
	if err != nil {
		return progress.Record{}, false, fmt.Errorf("read progress from %s: find the progressPartition's start: %w", s.topic, err)
	}
	var value []byte
	p := kafkaread.Partition{Client: s.client, Topic: s.topic, Partition: progressPartition}
	err = p.Read(ctx, next, kafkaread.StableEnd, func(r kafkaread.Record) {
		if string(r.Key) == string(key) {
			value = r.Value
		}
	})
	if err != nil {
		return progress.Record{}, false, fmt.Errorf("read progress: %w", err)
	}
	if value == nil {
		return progress.Record{}, false, nil
	}
	rec, err = progress.Unmarshal(value)
	if err != nil {
		return progress.Record{}, false, fmt.Errorf("%w: %s on %s: %w", progress.ErrBadRecord, key, s.topic, err)
	}
	return rec, true, nil
}
