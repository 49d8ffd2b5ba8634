package publisher

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/IBM/sarama"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/sink"
)

// PartitionRecord is where the relay keeps, for each event topic, the
// partition count its keys are mapped by: durably, beside the data
// (store.Partitions), so a restart, a second instance or a new version
// maps every key as before.
type PartitionRecord interface {
	// Pin returns the count recorded for topic, first recording actual
	// when none is; recorded says this call recorded it.
	Pin(ctx context.Context, topic string, actual int32) (n int32, recorded bool, err error)
	// Recorded returns the count recorded for topic, 0 when none is.
	Recorded(ctx context.Context, topic string) (int32, error)
}

// TopicDeletedError is an event topic missing on the brokers that the
// relay published to before (its partition count is recorded): it was
// deleted. Its events wait in PostgreSQL until it exists again. Taken for
// a topic that never existed, they would be quarantined, and published
// again only by a replay after the events that came once the topic was
// back: per-aggregate order broken for every one of them.
type TopicDeletedError struct {
	Topic    string
	Recorded int32
}

func (e *TopicDeletedError) Error() string {
	return fmt.Sprintf("event topic %s does not exist on the brokers, but the relay published to it before (%d partitions recorded): it was deleted. "+
		"Its events wait in PostgreSQL, and the relay tries again with backoff. Create it again with %d partitions "+
		"(kafka-topics.sh --create --topic %s --partitions %d, with its earlier replication factor and configuration), "+
		"then reset its consumer groups to the new topic's start (kafka-consumer-groups.sh --reset-offsets --to-earliest --topic %s) and check what they lost with `outbox-relay reconcile`; see %s", e.Topic, e.Recorded, e.Recorded, e.Topic, e.Recorded, e.Topic, PartitionsDoc)
}

// deleted says whether topic, missing on the brokers, was published to
// before.
func (p *Partitions) deleted(ctx context.Context, topic string) (*TopicDeletedError, error) {
	n, err := p.record.Recorded(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("read the partition count recorded for topic %s: %w", topic, err)
	}
	if n == 0 {
		return nil, nil
	}
	return &TopicDeletedError{Topic: topic, Recorded: n}, nil
}

// PartitionsDoc is where an operator reads the procedure.
const PartitionsDoc = "docs/partitions.md"

// Partitions maps each event topic's keys by the partition count recorded
// for it, not by the count the topic has now. Adding partitions to a topic
// would otherwise move most keys at once (murmur2 modulo the new count)
// while their earlier records still wait, unread, in the old partitions:
// per-aggregate order breaks for every consumer that lags, silently. Keys
// stay where they were until an operator adopts the new count (outbox-relay
// partitions adopt) with the relay stopped and the consumers caught up.
//
// One Partitions serves every sink of a process; the per-record cost is
// one atomic load in the partitioner.
type Partitions struct {
	record PartitionRecord
	log    zerolog.Logger

	mu      sync.Mutex
	topics  map[string]*pin
	observe func(topic string, actual, used int32)
	// overRecords is told each topic whose count the relay recorded
	// while the topic already held records.
	overRecords func(topic string)
}

// pin is what the relay knows of one topic's partitions.
type pin struct {
	// used is the count keys are mapped by: the recorded one; 0 until it
	// was read.
	used atomic.Int32
	// actual is the count the brokers' metadata last showed.
	actual atomic.Int32
	// warned is the actual count last warned about, under Partitions.mu.
	warned int32
}

// NewPartitions maps keys by the counts of record.
func NewPartitions(record PartitionRecord, log zerolog.Logger) *Partitions {
	return &Partitions{record: record, log: log, topics: make(map[string]*pin)}
}

// Observe has fn told every count the relay learns (for the gauges); set
// it before the first sink is made.
func (p *Partitions) Observe(fn func(topic string, actual, used int32)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.observe = fn
}

// ObserveRecordedOverRecords has fn told each topic whose count the relay
// recorded, as on its first start, while the topic already held records
// (for the counter); set it before the first sink is made.
func (p *Partitions) ObserveRecordedOverRecords(fn func(topic string)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.overRecords = fn
}

// MsgRecordedOverRecords is the relay's warning when it recorded a
// topic's partition count while the topic already held records.
const MsgRecordedOverRecords = "recorded the event topic's partition count, but the topic already holds records: the partitions its keys were mapped by before are unknown to the relay"

// recordedOverRecords warns that the relay recorded used as topic's count
// (no count was recorded: the registry was lost, or restored without its
// row) while the topic already held records, which may have been written
// with another count.
func (p *Partitions) recordedOverRecords(topic string, used int32) {
	p.mu.Lock()
	fn := p.overRecords
	p.mu.Unlock()
	if fn != nil {
		fn(topic)
	}
	p.log.Warn().Str("topic", topic).Int32("partitions_recorded", used).
		Str("procedure", fmt.Sprintf("no partition count was recorded for topic %s (outbox_relay_partitions dropped, or restored without its row), so the relay recorded its count now, %d, and maps keys by it. "+
			"Check with `outbox-relay partitions show`. If the topic's partition count changed since its earlier records were written, keys may have moved: "+
			"stop the relay (events wait in PostgreSQL) and adopt the count those records were written with, "+
			"`outbox-relay partitions adopt --event-topic %s --partitions N --consumer-groups <every group that reads it>` with the relay's flags, then start the relay; see %s",
			topic, used, topic, PartitionsDoc)).
		Msg(MsgRecordedOverRecords)
}

// pinOf returns topic's entry, made on first use.
func (p *Partitions) pinOf(topic string) *pin {
	p.mu.Lock()
	defer p.mu.Unlock()
	pn, ok := p.topics[topic]
	if !ok {
		pn = &pin{}
		p.topics[topic] = pn
	}
	return pn
}

// names are the topics met so far, for the metadata watch.
func (p *Partitions) names() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, 0, len(p.topics))
	for name, pn := range p.topics {
		if pn.used.Load() > 0 {
			out = append(out, name)
		}
	}
	return out
}

// PartitionsShrunkError is a topic with fewer partitions than its keys
// are mapped by: it was deleted and made again. Publishing to it would put
// keys on partitions that do not exist, or on others than their earlier
// records, so the relay stops.
type PartitionsShrunkError struct {
	Topic          string
	Recorded, Have int32
}

func (e *PartitionsShrunkError) Error() string {
	return fmt.Sprintf("event topic %s has %d partitions, fewer than the %d its keys are mapped by: it was deleted and created again. "+
		"The relay publishes nothing to it. Recreate it with %d partitions or more (keys then stay where they were), "+
		"or, to map keys by %d from now on, run `outbox-relay partitions adopt --event-topic %s --partitions %d --consumer-groups <every group that reads it>` "+
		"with the relay stopped; see %s", e.Topic, e.Have, e.Recorded, e.Recorded, e.Have, e.Topic, e.Have, PartitionsDoc)
}

func (e *PartitionsShrunkError) Unwrap() error { return sink.ErrTopicPartitions }

// learn reads, or records, the count topic's keys are mapped by, on the
// first use of the topic in a session: a PostgreSQL round trip per topic
// and session, none per record. recorded says this call recorded it.
func (p *Partitions) learn(ctx context.Context, topic string, actual int32) (used int32, recorded bool, err error) {
	used, recorded, err = p.record.Pin(ctx, topic, actual)
	if err != nil {
		return 0, false, fmt.Errorf("read the partition count recorded for topic %s: %w", topic, err)
	}
	if used > actual {
		p.seen(topic, actual, used)
		return 0, recorded, &PartitionsShrunkError{Topic: topic, Recorded: used, Have: actual}
	}
	p.pinOf(topic).used.Store(used)
	p.seen(topic, actual, used)
	return used, recorded, nil
}

// seen notes a topic's actual count from the brokers' metadata, reports
// it, and warns once per topic and count when keys are not mapped by it.
func (p *Partitions) seen(topic string, actual, used int32) {
	pn := p.pinOf(topic)
	pn.actual.Store(actual)
	p.mu.Lock()
	observe := p.observe
	warn := used > 0 && actual != used && pn.warned != actual
	if warn {
		pn.warned = actual
	}
	p.mu.Unlock()
	if observe != nil {
		observe(topic, actual, used)
	}
	if !warn {
		return
	}
	if actual < used {
		p.log.Error().Str("topic", topic).Int32("partitions_recorded", used).Int32("partitions", actual).
			Msg("the event topic's partition count changed: it has fewer partitions than its keys are mapped by (deleted and created again); the relay publishes nothing to it, see " + PartitionsDoc)
		return
	}
	p.log.Warn().Str("topic", topic).Int32("partitions_recorded", used).Int32("partitions", actual).
		Str("procedure", fmt.Sprintf("keys stay on the partitions of %d, so per-aggregate order holds; partitions %d to %d get nothing. "+
			"To spread keys over all %d: stop the relay (events wait in PostgreSQL), wait until every consumer group of the topic has read to the end, "+
			"run `outbox-relay partitions adopt --event-topic %s --consumer-groups <groups>` with the relay's flags, then start the relay; see %s",
			used, used, actual-1, actual, topic, PartitionsDoc)).
		Msg("the event topic's partition count changed")
}

// check compares the brokers' current count of every topic met with the
// count its keys are mapped by; the metadata watch calls it.
func (p *Partitions) check(client sarama.Client, log zerolog.Logger) {
	names := p.names()
	if len(names) == 0 {
		return
	}
	if err := client.RefreshMetadata(names...); err != nil {
		log.Debug().Err(err).Msg("refresh the event topics' metadata")
	}
	for _, name := range names {
		parts, err := client.Partitions(name)
		if err != nil {
			continue // a topic gone is the resolver's and the producer's to report
		}
		p.seen(name, int32(len(parts)), p.pinOf(name).used.Load())
	}
}

// partitioner is the sarama partitioner constructor of a producer: sarama
// makes one partitioner per topic, on the topic's first record.
func (p *Partitions) partitioner(topic string) sarama.Partitioner {
	return &pinnedPartitioner{topic: topic, pin: p.pinOf(topic)}
}

// pinnedPartitioner places keys like the Java client, modulo the count
// recorded for the topic.
type pinnedPartitioner struct {
	topic string
	pin   *pin
}

func (pp *pinnedPartitioner) Partition(msg *sarama.ProducerMessage, numPartitions int32) (int32, error) {
	used := pp.pin.used.Load()
	if used == 0 {
		// A topic no lookup pinned: not an event topic (the exactly-once
		// sink's progress record shares the producer). Event records are
		// built only after their topic's count was read.
		return javaPartitioner{}.partitionBy(msg, numPartitions)
	}
	if used > numPartitions {
		// Made again smaller: any choice would move keys.
		return 0, &PartitionsShrunkError{Topic: pp.topic, Recorded: used, Have: numPartitions}
	}
	return javaPartitioner{}.partitionBy(msg, used)
}

// RequiresConsistency is true: a key must land on its partition even while
// that partition is unavailable, or per-aggregate order breaks.
func (pp *pinnedPartitioner) RequiresConsistency() bool { return true }
