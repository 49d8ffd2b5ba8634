// Package kafkaread reads the committed records of one Kafka partition with
// plain read (fetch) requests in read_committed isolation. It is shared by
// the progress store, which reads its topic back at every start, and by
// reconcile, which reads the event topics.
//
// sarama's partition consumer hides control records. A partition written
// with Kafka transactions ends in a commit marker, so a consumer waiting to
// see the offset before the partition's end never returns. This reader sees
// every batch, markers included, and so knows when it has passed an offset;
// it also drops the records of aborted transactions.
package kafkaread

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

// Record is one committed record.
type Record struct {
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []*sarama.RecordHeader
	Timestamp time.Time
}

// StableEnd as Read's end reads up to the partition's last stable offset
// (or its high watermark, if lower) as the first read finds it.
const StableEnd int64 = -1

// Partition names the partition to read and how patient to be.
type Partition struct {
	Client    sarama.Client
	Topic     string
	Partition int32
	// Stall is how long reads may make no headway (an error, a leader
	// that moved, a transaction still open below the end) before Read
	// gives up. 0 gives up at the first read that fails or finds nothing.
	Stall time.Duration
}

// readBytes bounds one read request: it holds thousands of records while
// never asking for much memory.
const readBytes = 1 << 20

// retryEvery paces the reads while no headway is made; the broker's own
// wait (maxWait) paces them when there is nothing new to read.
const (
	retryEvery = 100 * time.Millisecond
	maxWait    = 100 * time.Millisecond
)

// Read calls fn, in offset order, with each committed record of the
// partition from offset from up to, not including, end (or StableEnd).
// Records of aborted transactions and transaction markers are skipped.
// A record of a transaction still open at end is waited for until it
// commits or aborts, within Stall. ctx bounds the whole read.
func (p Partition) Read(ctx context.Context, from, end int64, fn func(Record)) error {
	next := from
	aborted := map[int64]bool{} // producer ids inside an aborted transaction
	headway := time.Now()
	for end < 0 || next < end {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("read %s/%d: gave up at offset %d of %d: %w", p.Topic, p.Partition, next, end, err)
		}
		block, err := p.readAt(next)
		if err != nil {
			if p.Stall <= 0 || time.Since(headway) >= p.Stall {
				return err
			}
			// A moved leader or a broker that went away: look again.
			_ = p.Client.RefreshMetadata(p.Topic)
			if err := pause(ctx); err != nil {
				return fmt.Errorf("read %s/%d: gave up at offset %d of %d: %w", p.Topic, p.Partition, next, end, err)
			}
			continue
		}
		if end < 0 {
			end = block.LastStableOffset
			if end < 0 || block.HighWaterMarkOffset < end {
				end = block.HighWaterMarkOffset
			}
		}
		if next < block.LogStartOffset {
			next = block.LogStartOffset
		}
		before := next
		next, err = readBlock(block, next, end, aborted, fn)
		if err != nil {
			return fmt.Errorf("read %s/%d: %w", p.Topic, p.Partition, err)
		}
		if next > before {
			headway = time.Now()
			continue
		}
		if next >= end {
			break
		}
		if p.Stall <= 0 || time.Since(headway) >= p.Stall {
			return fmt.Errorf("read %s/%d: nothing readable at offset %d although the partition ends at %d (last stable offset %d)",
				p.Topic, p.Partition, next, end, block.LastStableOffset)
		}
		// An open transaction holds the last stable offset below end.
		if err := pause(ctx); err != nil {
			return fmt.Errorf("read %s/%d: gave up at offset %d of %d: %w", p.Topic, p.Partition, next, end, err)
		}
	}
	return nil
}

// readBlock hands fn the committed records of block at offsets [next, end)
// and returns the offset after the last batch it went through.
func readBlock(block *sarama.FetchResponseBlock, next, end int64, aborted map[int64]bool, fn func(Record)) (int64, error) {
	// An aborted transaction's records run from its FirstOffset to its
	// producer's abort marker; the response lists those it overlaps.
	pending := slices.SortedFunc(slices.Values(block.AbortedTransactions), func(a, b *sarama.AbortedTransaction) int {
		return cmp.Compare(a.FirstOffset, b.FirstOffset)
	})
	for _, records := range block.RecordsSet {
		if records.MsgSet != nil && records.RecordBatch == nil {
			return next, fmt.Errorf("offset %d is in the message format of Kafka before 0.11, which this reader does not read; read the topic with a consumer of your own", next)
		}
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
				if off < next || off >= end {
					continue
				}
				at := batch.FirstTimestamp.Add(r.TimestampDelta)
				if batch.LogAppendTime {
					at = batch.MaxTimestamp
				}
				fn(Record{Offset: off, Key: r.Key, Value: r.Value, Headers: r.Headers, Timestamp: at})
			}
		}
		next = batch.LastOffset() + 1
	}
	return next, nil
}

// readAt asks the partition's leader for data from offset, read_committed.
func (p Partition) readAt(offset int64) (*sarama.FetchResponseBlock, error) {
	leader, err := p.Client.Leader(p.Topic, p.Partition)
	if err != nil {
		return nil, fmt.Errorf("read %s/%d: %w", p.Topic, p.Partition, err)
	}
	req := &sarama.FetchRequest{
		Version:     readVersion(p.Client.Config().Version),
		MaxWaitTime: int32(maxWait.Milliseconds()),
		MinBytes:    1,
		MaxBytes:    readBytes,
		Isolation:   sarama.ReadCommitted,
	}
	req.AddBlock(p.Topic, p.Partition, offset, readBytes, -1)
	resp, err := leader.Fetch(req)
	if err != nil {
		return nil, fmt.Errorf("read %s/%d at offset %d: %w", p.Topic, p.Partition, offset, err)
	}
	block := resp.GetBlock(p.Topic, p.Partition)
	if block == nil {
		return nil, fmt.Errorf("read %s/%d at offset %d: %w", p.Topic, p.Partition, offset, sarama.ErrIncompleteResponse)
	}
	if !errors.Is(block.Err, sarama.ErrNoError) {
		return nil, fmt.Errorf("read %s/%d at offset %d: %w", p.Topic, p.Partition, offset, block.Err)
	}
	return block, nil
}

// pause waits retryEvery, or until ctx ends.
func pause(ctx context.Context) error {
	t := time.NewTimer(retryEvery)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

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
