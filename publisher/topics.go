package publisher

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/internal/topicconfig"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/tracing"
)

// topicResolver turns events into records for both sinks: it resolves each
// event's topic from the template and, the first time it meets a topic,
// looks it up in the background (does it exist, what is its
// max.message.bytes), so building never blocks on Kafka. It is used from
// the one goroutine that calls Build.
type topicResolver struct {
	cfg      Config
	log      zerolog.Logger
	template *topicTemplate
	client   sarama.Client
	admin    sarama.ClusterAdmin

	known   map[string]*topicInfo
	missing map[string]missingTopic
	lookups map[string]*lookup

	// spans are the trace spans of records in flight; nil without tracing.
	spans *spanTable

	quit    chan struct{} // closed by stop: lookups give up waiting
	stopped sync.Once
	running sync.WaitGroup // lookups under way
}

func newTopicResolver(cfg Config, log zerolog.Logger, template *topicTemplate, client sarama.Client, admin sarama.ClusterAdmin) *topicResolver {
	t := &topicResolver{
		cfg: cfg, log: log, template: template, client: client, admin: admin,
		known: make(map[string]*topicInfo), missing: make(map[string]missingTopic), lookups: make(map[string]*lookup),
		quit: make(chan struct{}), spans: newSpanTable(cfg),
	}
	if cfg.Partitions != nil {
		t.running.Add(1)
		go func() {
			defer t.running.Done()
			t.watchPartitions()
		}()
	}
	return t
}

// partitionCheckEvery is how often the metadata watch asks the brokers for
// the event topics' partition counts. sarama's own refresh comes every ten
// minutes; an operator who added partitions should see the relay's warning
// and gauge within seconds. One metadata request for a few topics costs the
// brokers next to nothing.
const partitionCheckEvery = 10 * time.Second

// watchPartitions notices, while the relay runs, a change of an event
// topic's partition count: the keys stay mapped by the recorded count
// whatever it finds, so this only tells the operator.
func (t *topicResolver) watchPartitions() {
	tick := time.NewTicker(partitionCheckEvery)
	defer tick.Stop()
	for {
		select {
		case <-t.quit:
			return
		case <-tick.C:
		}
		t.cfg.Partitions.check(t.client, t.log)
	}
}

// stop makes lookups under way give up; wait waits for them to end.
func (t *topicResolver) stop() { t.stopped.Do(func() { close(t.quit) }) }
func (t *topicResolver) wait() { t.running.Wait() }

// topicInfo is what the publisher learned of a topic on first use.
type topicInfo struct {
	name     string
	maxBytes int // the topic's max.message.bytes
}

// missingTopic remembers that a topic was not there, so each event for it
// does not wait out TopicWait again.
type missingTopic struct {
	err   *sink.Error
	until time.Time
}

// missingTopicExpiry is how long a topic found missing stays missing before
// it is looked up again: long enough that a stream of events for it costs
// one TopicWait per minute, short enough that a topic created by hand is
// noticed soon.
const missingTopicExpiry = time.Minute

// lookup is one topic discovery running in the background.
type lookup struct {
	done  chan struct{}
	topic *topicInfo // set before done is closed
	err   error
}

// build turns an event into a record. It fails with a permanent *Error when
// Kafka could never accept the record (bad topic name, missing topic, too
// large, malformed headers), with a *sink.BatchLimitError when the topic needs a
// producer with smaller batches, and with a *TopicPendingError while the
// event's topic is being looked up. It never blocks, and must be called from
// one goroutine.
func (t *topicResolver) build(ev *event.Event) (*Record, error) {
	topic, err := t.topic(ev)
	if err != nil {
		return nil, err
	}
	r, err := build(ev, topic.name)
	if err != nil {
		return nil, recordError(sink.ClassPermanent, string(ev.EventID), topic.name, -1, err, nil)
	}
	var span *tracing.Span
	if t.cfg.Tracing != nil {
		var resized bool
		if span, resized = t.cfg.Tracing.Start(&r.rec, ev, topic.name, ev.CommitTime); resized {
			r.msg.Headers = saramaHeaders(r.rec.Headers)
			r.size = int32(r.msg.ByteSize(2))
		}
	}
	if limit := min(topic.maxBytes-recordBatchOverhead, t.cfg.batchBytes()); r.Size() > limit {
		sizeErr := &LocalSizeError{Size: r.Size(), Limit: limit, TopicMax: topic.maxBytes, ProducerMax: t.cfg.MaxMessageBytes}
		if t.cfg.batchBytes() < t.cfg.MaxMessageBytes {
			sizeErr.LoweredTo = t.cfg.batchBytes()
		}
		span.End(-1, -1, sizeErr, time.Now())
		return nil, recordError(sink.ClassPermanent, string(ev.EventID), topic.name, -1, sizeErr, nil)
	}
	if span != nil {
		t.spans.put(r, span)
	}
	return r, nil
}

// topic resolves and, on first use, checks an event's topic.
func (t *topicResolver) topic(ev *event.Event) (*topicInfo, error) {
	var scratch [256]byte
	name := t.template.appendName(scratch[:0], ev)
	if t, ok := t.known[string(name)]; ok {
		return t, nil
	}
	return t.lookUp(string(name), string(ev.EventID))
}

// lookUp answers from a finished or cached lookup of a topic met for the
// first time, or starts one in the background: a slow or unreachable broker
// can make a lookup take as long as sarama's metadata retries, and a topic
// that is not created takes TopicWait.
func (t *topicResolver) lookUp(name, eventID string) (*topicInfo, error) {
	if m, ok := t.missing[name]; ok {
		if time.Now().Before(m.until) {
			perm := *m.err
			perm.EventID = eventID
			return nil, &perm
		}
		delete(t.missing, name)
	}
	l, ok := t.lookups[name]
	if !ok {
		l = &lookup{done: make(chan struct{})}
		t.lookups[name] = l
		t.running.Add(1)
		go func() {
			defer t.running.Done()
			l.topic, l.err = t.discover(name)
			close(l.done)
		}()
	}
	select {
	case <-l.done:
	default:
		return nil, &sink.TopicPendingError{Topic: name, Done: l.done}
	}
	delete(t.lookups, name)
	if l.err != nil {
		var perm *sink.Error
		if errors.As(l.err, &perm) {
			if errors.Is(perm.Err, sarama.ErrUnknownTopicOrPartition) {
				t.missing[name] = missingTopic{err: perm, until: time.Now().Add(missingTopicExpiry)}
			}
			copied := *perm
			copied.EventID = eventID
			return nil, &copied
		}
		return nil, l.err
	}
	t.known[name] = l.topic
	return l.topic, nil
}

// discover checks that a topic exists and learns its max.message.bytes, so
// an oversize record is caught before it is sent. Sent, it would fail its
// whole batch and take innocent neighbours, and their order, down with it.
func (t *topicResolver) discover(name string) (*topicInfo, error) {
	if err := validTopicName(name); err != nil {
		return nil, recordError(sink.ClassPermanent, "", name, -1, err, nil)
	}
	deadline := time.Now().Add(t.cfg.TopicWait)
	for {
		err := t.client.RefreshMetadata(name)
		if err == nil {
			_, err = t.client.Partitions(name)
		}
		if err == nil {
			break
		}
		if !errors.Is(err, sarama.ErrUnknownTopicOrPartition) && !errors.Is(err, sarama.ErrLeaderNotAvailable) {
			return nil, fmt.Errorf("look up topic %s: %w", name, err)
		}
		if time.Now().After(deadline) {
			if t.cfg.Partitions != nil {
				gone, err := t.wasDeleted(name)
				if err != nil {
					return nil, err
				}
				if gone != nil {
					t.log.Error().Str("topic", name).Int32("recorded_partitions", gone.Recorded).Msg(gone.Error())
					return nil, gone
				}
			}
			return nil, recordError(sink.ClassPermanent, "", name, -1,
				fmt.Errorf("%w: topic does not exist and the brokers did not create it", sarama.ErrUnknownTopicOrPartition), nil)
		}
		// The broker may be creating the topic: poll its metadata.
		select {
		case <-time.After(200 * time.Millisecond):
		case <-t.quit:
			return nil, errors.New("look up topic " + name + ": sink closed")
		}
	}

	if t.cfg.Partitions != nil {
		if err := t.pin(name); err != nil {
			return nil, err
		}
	}

	info := &topicInfo{name: name, maxBytes: t.cfg.batchBytes() + recordBatchOverhead}
	maxBytes, found, err := topicconfig.Value(t.admin, name, "max.message.bytes")
	if err != nil {
		t.log.Warn().Err(err).Str("topic", name).
			Msg("could not read the topic's max.message.bytes; grant DescribeConfigs on the topic so oversize records are caught before they are sent")
	}
	if found {
		if v, err := strconv.Atoi(maxBytes); err == nil {
			info.maxBytes = v
		}
	}
	if info.maxBytes-recordBatchOverhead < t.cfg.batchBytes() {
		return nil, &sink.BatchLimitError{Topic: name, MaxMessageBytes: info.maxBytes - recordBatchOverhead}
	}
	t.log.Debug().Str("topic", name).Int("max_message_bytes", info.maxBytes).Msg("topic ready")
	return info, nil
}

// wasDeleted asks the partition record whether a missing topic was
// published to before, within --kafka-timeout.
func (t *topicResolver) wasDeleted(name string) (*TopicDeletedError, error) {
	ctx, cancel := context.WithTimeout(context.Background(), t.cfg.Timeout)
	defer cancel()
	return t.cfg.Partitions.deleted(ctx, name)
}

// pin reads the partition count a topic's keys are mapped by, recording
// its current count on the first use of the topic, before any of its
// records is built.
func (t *topicResolver) pin(name string) error {
	parts, err := t.client.Partitions(name)
	if err != nil {
		return fmt.Errorf("look up topic %s: %w", name, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), t.cfg.Timeout)
	defer cancel()
	go func() { // a closing sink gives up on PostgreSQL too
		select {
		case <-t.quit:
			cancel()
		case <-ctx.Done():
		}
	}()
	used, recorded, err := t.cfg.Partitions.learn(ctx, name, int32(len(parts)))
	if err != nil || !recorded {
		return err
	}
	// The relay recorded the topic's count, as on its first start: if the
	// topic already holds records, they may have been written with
	// another count (a registry dropped, or restored without the row).
	// One ListOffsets per partition, on the topic's first sight only.
	held, err := topicHoldsRecords(t.client, name, parts)
	if err != nil {
		t.log.Warn().Err(err).Str("topic", name).Int32("partitions_recorded", used).
			Msg("recorded the event topic's partition count, and could not check whether the topic already held records; check with `outbox-relay partitions show`, see " + PartitionsDoc)
		return nil
	}
	if held {
		t.cfg.Partitions.recordedOverRecords(name, used)
	}
	return nil
}

// topicHoldsRecords says whether any partition of topic has an end offset
// above 0.
func topicHoldsRecords(client sarama.Client, topic string, parts []int32) (bool, error) {
	for _, p := range parts {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return false, fmt.Errorf("read the end offset of %s/%d: %w", topic, p, err)
		}
		if end > 0 {
			return true, nil
		}
	}
	return false, nil
}
