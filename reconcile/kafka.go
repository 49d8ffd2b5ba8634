package reconcile

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/internal/kafkaread"
	"github.com/outbox-relay/outbox-relay/publisher"
)

// partitionRange is the part of one partition a comparison reads.
type partitionRange struct {
	topic     string
	partition int32
	from, to  int64 // offsets [from, to); to is the high watermark at the start
	// truncated: records were deleted from the partition's start, and the
	// window reaches back to what is left.
	truncated bool
}

// scanResult is what the partition readers found besides the row counts.
type scanResult struct {
	records       int64
	unidentified  int64
	candidates    []Phantom // records in the phantom window with no window row
	missingTopics []string
	truncated     []string // partitions whose retention may have deleted window records
}

// scanKafka reads every partition of topics from (Since - Margin) to the
// high watermark taken now, marking the records of window rows in rows.
func scanKafka(ctx context.Context, cfg Config, topics []string, rows *rowSet, phantomSince time.Time,
	progress *counters, log zerolog.Logger) (*scanResult, error) {
	res := &scanResult{}
	progress.enter("kafka", 0)
	if len(topics) == 0 {
		return res, nil
	}
	progress.waitOn(fmt.Sprintf("connecting to brokers %v", cfg.Kafka.Brokers))
	client, err := publisher.Within(ctx, cfg.Kafka, "connect to Kafka", func() (sarama.Client, error) { return publisher.NewReadClient(cfg.Kafka) },
		func(c sarama.Client) { c.Close() })
	if err != nil {
		return nil, err
	}
	defer client.Close()

	progress.waitOn(fmt.Sprintf("partition offsets of %d topic(s)", len(topics)))
	ranges, missing, err := partitionRanges(client, topics, cfg.Since.Add(-cfg.Margin))
	if err != nil {
		return nil, err
	}
	res.missingTopics = missing
	for _, topic := range missing {
		log.Warn().Str("topic", topic).Msg("topic does not exist in Kafka: every row routed to it is missing")
	}
	for _, r := range ranges {
		if r.truncated {
			name := fmt.Sprintf("%s/%d", r.topic, r.partition)
			res.truncated = append(res.truncated, name)
			log.Warn().Str("partition", name).
				Msg("Kafka deleted this partition's oldest records and the window starts at or before what is left: rows whose records retention deleted show as missing; shorten the window to the topic's retention")
		}
	}
	var total int64
	for _, r := range ranges {
		total += r.to - r.from
	}
	progress.enter("kafka", total)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	for _, r := range ranges {
		if r.from >= r.to {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			reader := partitionReader{r: r, rows: rows, phantomSince: phantomSince, until: cfg.Until,
				stall: cfg.Stall, done: &progress.done, idHeader: cfg.Postgres.OutboxLayout().EventIDHeader(),
				idInValue: cfg.Postgres.OutboxLayout().EventIDHeader() == ""}
			err := reader.read(ctx, client)
			mu.Lock()
			defer mu.Unlock()
			res.records += reader.records
			res.unidentified += reader.unidentified
			res.candidates = append(res.candidates, reader.candidates...)
			if err != nil && firstErr == nil {
				firstErr = err
				cancel()
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return nil, firstErr
	}
	return res, ctx.Err()
}

// partitionRanges finds, for each partition, the first offset at or after
// from and the current high watermark.
func partitionRanges(client sarama.Client, topics []string, from time.Time) (ranges []partitionRange, missing []string, err error) {
	for _, topic := range topics {
		if err := client.RefreshMetadata(topic); err != nil && !errors.Is(err, sarama.ErrUnknownTopicOrPartition) &&
			!errors.Is(err, sarama.ErrInvalidTopic) {
			return nil, nil, fmt.Errorf("look up topic %s: %w", topic, err)
		}
		parts, err := client.Partitions(topic)
		if errors.Is(err, sarama.ErrUnknownTopicOrPartition) || errors.Is(err, sarama.ErrInvalidTopic) || (err == nil && len(parts) == 0) {
			missing = append(missing, topic)
			continue
		}
		if err != nil {
			return nil, nil, fmt.Errorf("look up partitions of %s: %w", topic, err)
		}
		for _, p := range parts {
			hwm, err := client.GetOffset(topic, p, sarama.OffsetNewest)
			if err != nil {
				return nil, nil, fmt.Errorf("high watermark of %s/%d: %w", topic, p, err)
			}
			oldest, err := client.GetOffset(topic, p, sarama.OffsetOldest)
			if err != nil {
				return nil, nil, fmt.Errorf("log start of %s/%d: %w", topic, p, err)
			}
			// A window with no start (a whole table) reads the whole log:
			// a timestamp before 1970 is no timestamp to Kafka.
			start := oldest
			if from.UnixMilli() > 0 {
				start, err = client.GetOffset(topic, p, from.UnixMilli())
			}
			if err != nil {
				return nil, nil, fmt.Errorf("offset for %s of %s/%d: %w (the brokers must support offsets by timestamp, Kafka 0.10.1+)",
					from.UTC().Format(time.RFC3339), topic, p, err)
			}
			if start < 0 || start > hwm {
				start = hwm // no record at or after from
			}
			ranges = append(ranges, partitionRange{topic: topic, partition: p, from: start, to: hwm,
				truncated: oldest > 0 && start <= oldest})
		}
	}
	return ranges, missing, nil
}

// partitionReader reads one partition range.
type partitionReader struct {
	r            partitionRange
	rows         *rowSet
	phantomSince time.Time
	until        time.Time
	stall        time.Duration
	done         *atomic.Int64
	// idHeader is the header that carries the event id in the layout's
	// records; empty is the relay's own, event_id.
	idHeader string
	// idInValue says the records carry the event id in the value, as a
	// structured CloudEvent's id, and in no header.
	idInValue bool

	records      int64
	unidentified int64
	candidates   []Phantom
}

const eventIDHeader = "event_id"

// read reads the partition's committed records in the range. It sends its
// own read requests (kafkaread) because a partition written with Kafka
// transactions ends in a commit marker, which sarama's consumer never hands
// over: waiting for the range's last offset would never end. Records of
// aborted transactions do not count: read_committed consumers never see
// them.
func (p *partitionReader) read(ctx context.Context, client sarama.Client) error {
	stall := p.stall
	if stall <= 0 {
		stall = time.Minute
	}
	part := kafkaread.Partition{Client: client, Topic: p.r.topic, Partition: p.r.partition, Stall: stall}
	err := part.Read(ctx, p.r.from, p.r.to, func(r kafkaread.Record) {
		p.record(r)
		p.done.Add(1)
	})
	if err != nil && ctx.Err() == nil {
		return fmt.Errorf("%w (if the offset is out of range, Kafka deleted those records: shorten the window; otherwise check the brokers, or raise --stall-timeout for slow clusters)", err)
	}
	return err
}

func (p *partitionReader) record(msg kafkaread.Record) {
	p.records++
	idHeader := p.idHeader
	if idHeader == "" {
		idHeader = eventIDHeader
	}
	var raw []byte
	if p.idInValue {
		raw, _ = event.CloudEventID(msg.Value)
	} else {
		for _, h := range msg.Headers {
			if h != nil && string(h.Key) == idHeader {
				raw = h.Value
				break
			}
		}
	}
	id, ok := ParseEventID(raw)
	inPhantomWindow := !msg.Timestamp.Before(p.phantomSince) && msg.Timestamp.Before(p.until)
	switch {
	case !ok:
		if inPhantomWindow {
			p.unidentified++
		}
	case p.rows.mark(id):
	case inPhantomWindow:
		p.candidates = append(p.candidates, Phantom{EventID: id, Topic: p.r.topic, Partition: p.r.partition,
			Offset: msg.Offset, Timestamp: msg.Timestamp.UTC()})
	}
}
