package progress

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/IBM/sarama"
)

// Latest reads the partition from its start to the end that was stable when
// the read began and returns the last record for key. It reads committed
// data only (read_committed): records of aborted Kafka transactions are
// skipped, and the read stops at the last stable offset, so a record in a
// transaction still open never counts. found is false when no record for
// key exists. ctx bounds the whole read.
//
// It sends its own read requests instead of using sarama's partition
// consumer, which hides control records: with transactions the last offset
// before the end is a commit marker, and a consumer waiting to see it would
// never return.
func (s *Store) Latest(ctx context.Context, key []byte) (rec Record, found bool, err error) {
	var value []byte
	end := int64(-1)
	next, err := s.client.GetOffset(s.topic, partition, sarama.OffsetOldest)
	if err != nil {
		return Record{}, false, fmt.Errorf("read progress from %s: find the partition's start: %w", s.topic, err)
	}
	aborted := map[int64]bool{}
	for end < 0 || next < end {
		if err := ctx.Err(); err != nil {
			return Record{}, false, fmt.Errorf("read progress from %s: gave up at offset %d of %d: %w", s.topic, next, end, err)
		}
		block, err := s.readAt(next)
		if err != nil {
			return Record{}, false, err
		}
		if end < 0 {
			end = block.LastStableOffset
			if end < 0 || block.HighWaterMarkOffset < end {
				end = block.HighWaterMarkOffset
			}
			if next < block.LogStartOffset {
				next = block.LogStartOffset
			}
		}
		// An aborted transaction's records run from its FirstOffset to its
		// producer's abort marker; the response lists those it overlaps.
		pending := slices.SortedFunc(slices.Values(block.AbortedTransactions), func(a, b *sarama.AbortedTransaction) int {
			return cmp.Compare(a.FirstOffset, b.FirstOffset)
		})
		moved := false
		for _, records := range block.RecordsSet {
			batch := records.RecordBatch
			if batch == nil || batch.PartialTrailingRecord {
				continue
			}
			for len(pending) > 0 && pending[0].FirstOffset <= batch.LastOffset() {
				aborted[pending[0].ProducerID] = true
				pending = pending[1:]
			}
			if batch.LastOffset() < next {
				continue // a batch that began before the offset asked for, already read
			}
			switch {
			case batch.Control:
				if isAbortMarker(batch) {
					delete(aborted, batch.ProducerID)
				}
			case batch.IsTransactional && aborted[batch.ProducerID]:
			default:
				for _, r := range batch.Records {
					off := batch.FirstOffset + r.OffsetDelta
					if off >= next && off < end && string(r.Key) == string(key) {
						value = r.Value
					}
				}
			}
			next = batch.LastOffset() + 1
			moved = true
		}
		if !moved && next < end {
			return Record{}, false, fmt.Errorf("read progress from %s: no data at offset %d although the partition ends at %d", s.topic, next, end)
		}
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

// readAt asks the partition's leader for data from offset, read_committed.
func (s *Store) readAt(offset int64) (*sarama.FetchResponseBlock, error) {
	leader, err := s.client.Leader(s.topic, partition)
	if err != nil {
		return nil, fmt.Errorf("read progress from %s: %w", s.topic, err)
	}
	req := &sarama.FetchRequest{
		Version:     readVersion(s.client.Config().Version),
		MaxWaitTime: int32((100 * time.Millisecond).Milliseconds()),
		MinBytes:    1,
		MaxBytes:    readBytes,
		Isolation:   sarama.ReadCommitted,
	}
	req.AddBlock(s.topic, partition, offset, readBytes, -1)
	resp, err := leader.Fetch(req)
	if err != nil {
		return nil, fmt.Errorf("read progress from %s at offset %d: %w", s.topic, offset, err)
	}
	block := resp.GetBlock(s.topic, partition)
	if block == nil {
		return nil, fmt.Errorf("read progress from %s at offset %d: %w", s.topic, offset, sarama.ErrIncompleteResponse)
	}
	if !errors.Is(block.Err, sarama.ErrNoError) {
		return nil, fmt.Errorf("read progress from %s at offset %d: %w", s.topic, offset, block.Err)
	}
	return block, nil
}

// readBytes bounds one read request; progress records are about 150 bytes, so
// this holds thousands while never asking for much memory.
const readBytes = 1 << 20

// readVersion is the newest version of Kafka's read request that the
// configured protocol version offers among those that carry the isolation
// level and the last stable offset (4 and later; Kafka 4 dropped 0 to 3).
func readVersion(v sarama.KafkaVersion) int16 {
	switch {
	case v.IsAtLeast(sarama.V2_3_0_0):
		return 11
	case v.IsAtLeast(sarama.V2_1_0_0):
		return 10
	case v.IsAtLeast(sarama.V1_1_0_0):
		return 7
	}
	return 5
}

// isAbortMarker reports whether a control batch is an abort marker: its
// record's key is a version (int16) and a type (int16), 0 for abort.
func isAbortMarker(batch *sarama.RecordBatch) bool {
	if len(batch.Records) == 0 || len(batch.Records[0].Key) < 4 {
		return false
	}
	return binary.BigEndian.Uint16(batch.Records[0].Key[2:4]) == 0
}
