// Package publisher talks to Kafka. It gives each outbox event its topic
// (from a template) and wraps the record the event's shape builds (see
// package event) in a producer message, partitions it as Java clients do,
// sends it through an idempotent sarama producer, and reports every
// acknowledgement and failure with the event's position so the caller can
// decide what is safe to confirm. It knows nothing of WAL or replication
// slots.
package publisher

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/internal/backoff"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/tracing"
)

// Config says how to reach Kafka and how to shape records.
type Config struct {
	Brokers       []string
	TopicTemplate string // e.g. "outbox.event.{aggregate_type}"
	Compression   string // none, gzip, snappy, lz4, zstd
	KafkaVersion  string // protocol version to speak, e.g. "3.6.0"
	ClientID      string
	// Throttle counts the brokers' throttle times (quotas); nil: not
	// counted.
	Throttle *Throttle
	// SeverOnFailure cuts the producer off from the brokers at its first
	// failure that is not a refusal of the record (see sever): for a
	// caller that then abandons the sink and sends again from what it
	// confirmed. A caller that goes on with the sink after a failure (poll
	// mode's bounded sinks, which retry per event and hold the rest of
	// its aggregate back) leaves it off.
	SeverOnFailure bool

	// MaxMessageBytes is the largest batch the producer builds for one
	// partition, and so the largest record it sends. Keep it at or below the
	// smallest max.message.bytes of the target topics.
	MaxMessageBytes int
	// BatchLimit, when set below MaxMessageBytes, is what the producer uses
	// instead: a topic takes smaller batches (see sink.BatchLimitError). Errors
	// still quote MaxMessageBytes, the value the operator gave.
	BatchLimit int

	// RetryMax bounds sarama's own retries of one record. sarama keeps a
	// partition's records in order only while it is still retrying them:
	// once a record runs out of retries, later records of its partition may
	// be appended before it is re-delivered. So the default is large enough
	// (hours at the backoff cap) that only a pathological outage exhausts
	// it; the caller then re-streams from the slot and counts the possible
	// order break. sarama allocates 32 bytes per allowed retry for each
	// partition it produces to.
	RetryMax        int
	RetryBackoffMax time.Duration

	// Linger is how long a batch may wait for more records before it is
	// sent when no request is in flight (Kafka's linger.ms). While a
	// request is in flight records gather anyway, so it matters only when
	// the relay is idle between events. The default, 2 ms, was measured at
	// steady rates: it halves the broker's CPU per event against sending
	// each event in a request of its own (see docs/memory-and-cpu.md).
	Linger time.Duration
	// Timeout bounds every wait for a broker: connecting, each request's
	// answer, and a metadata lookup over all brokers and retries. A broker
	// that accepts connections and never answers then fails the attempt
	// instead of holding it for minutes.
	Timeout time.Duration

	Security Security

	// TopicWait is how long a new topic may take to appear (for brokers that
	// create topics on first use) before it counts as missing.
	TopicWait time.Duration

	// Tracing, when set, makes a span of each record its sampler picks
	// (a child of the event's trace context, if it carries one), ended at
	// its outcome; nil (the default) turns tracing off at the cost of a
	// nil check per record.
	Tracing *tracing.Records

	// Partitions, when set, maps each event topic's keys by the partition
	// count recorded for it (see Partitions); nil maps them by the
	// topic's current count, for tests and tools that record nothing.
	Partitions *Partitions
}

// DefaultConfig returns the safe defaults the relay ships with.
func DefaultConfig() Config {
	return Config{
		TopicTemplate:   "outbox.event.{aggregate_type}",
		Compression:     "lz4",
		KafkaVersion:    "3.6.0",
		ClientID:        "outbox-relay",
		MaxMessageBytes: 1000000,
		RetryMax:        10000,
		RetryBackoffMax: 5 * time.Second,
		Linger:          2 * time.Millisecond,
		Timeout:         30 * time.Second,
		TopicWait:       10 * time.Second,
	}
}

func authFailure(err error) bool {
	var certErr *tls.CertificateVerificationError
	var unknownCA x509.UnknownAuthorityError
	var hostErr x509.HostnameError
	return errors.Is(err, sarama.ErrSASLAuthenticationFailed) || errors.As(err, &certErr) ||
		errors.As(err, &unknownCA) || errors.As(err, &hostErr)
}

// Publisher owns one sarama producer and the goroutines that feed it and
// drain its outcomes. It is built for one stream session: after a failure
// the caller closes it and makes a new one.
//
// Nothing in it calls back into its caller. Records go in through Input,
// results come out of Outcomes, and a topic it has not met yet is looked up
// in the background while Build answers *TopicPendingError, so the caller's
// own loop is never blocked by Kafka.
type Publisher struct {
	cfg      Config
	log      zerolog.Logger
	topics   *topicResolver
	admin    sarama.ClusterAdmin
	producer sarama.AsyncProducer

	input        chan sink.Item
	outcomes     chan sink.Outcome
	retries      atomic.Int64
	quit         chan struct{} // closed by Close: outcomes are no longer wanted
	closing      sync.Once
	adminClosing sync.Once
	severing     sync.Once
	workers      sync.WaitGroup
}

// New connects to Kafka and starts the producer.
func New(cfg Config, log zerolog.Logger) (*Publisher, error) {
	topics, err := parseTopicTemplate(cfg.TopicTemplate)
	if err != nil {
		return nil, err
	}
	sc, err := saramaConfig(cfg)
	if err != nil {
		return nil, err
	}
	p := &Publisher{cfg: cfg, log: log, input: make(chan sink.Item), outcomes: make(chan sink.Outcome, outcomeBuffer), quit: make(chan struct{})}
	backoff := sc.Producer.Retry.BackoffFunc
	sc.Producer.Retry.BackoffFunc = func(retries, maxRetries int) time.Duration {
		p.retries.Add(1)
		return backoff(retries, maxRetries)
	}
	client, admin, err := connect(cfg, sc)
	if err != nil {
		return nil, err
	}
	producer, err := sarama.NewAsyncProducerFromClient(client)
	if err != nil {
		admin.Close()
		return nil, fmt.Errorf("create kafka producer: %w", err)
	}
	p.topics = newTopicResolver(cfg, log, topics, client, admin)
	p.admin, p.producer = admin, producer
	p.workers.Add(2)
	go p.forward()
	go p.drainOutcomes()
	return p, nil
}

// outcomeBuffer lets the producer report a burst of acks while the caller
// is busy reading WAL, without stalling sarama's own goroutines.
const outcomeBuffer = 1024

func saramaConfig(cfg Config) (*sarama.Config, error) {
	sc, err := ClientConfig(cfg)
	if err != nil {
		return nil, err
	}
	codec, err := compressionCodec(cfg.Compression)
	if err != nil {
		return nil, err
	}
	sc.Producer.Compression = codec
	// Idempotence absorbs retries within one producer session without
	// duplicates or reordering; sarama insists on the rest of these with it.
	sc.Producer.Idempotent = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Net.MaxOpenRequests = 1
	sc.Producer.Retry.Max = max(cfg.RetryMax, 1)
	backoffMax := cfg.RetryBackoffMax
	sc.Producer.Retry.BackoffFunc = func(retries, _ int) time.Duration {
		return backoff.Delay(100*time.Millisecond, backoffMax, retries+1)
	}
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	sc.Producer.Partitioner = newJavaPartitioner
	if cfg.Partitions != nil {
		sc.Producer.Partitioner = cfg.Partitions.partitioner
	}
	sc.Producer.MaxMessageBytes = cfg.batchBytes()
	sc.Producer.Flush.Frequency = cfg.Linger
	sc.Metadata.AllowAutoTopicCreation = true
	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("kafka producer configuration: %w", err)
	}
	return sc, nil
}

func compressionCodec(name string) (sarama.CompressionCodec, error) {
	switch name {
	case "none", "":
		return sarama.CompressionNone, nil
	case "gzip":
		return sarama.CompressionGZIP, nil
	case "snappy":
		return sarama.CompressionSnappy, nil
	case "lz4":
		return sarama.CompressionLZ4, nil
	case "zstd":
		return sarama.CompressionZSTD, nil
	}
	return 0, fmt.Errorf("compression %q: use none, gzip, snappy, lz4 or zstd", name)
}

// Build turns an event into a record. It fails with a permanent *Error when
// Kafka could never accept the record (bad topic name, missing topic, too
// large, malformed headers), with a *sink.BatchLimitError when the topic needs a
// producer with smaller batches, and with a *TopicPendingError while the
// event's topic is being looked up. It never blocks, and must be called from
// one goroutine.
func (p *Publisher) Build(ev *event.Event) (sink.Record, error) {
	r, err := p.topics.build(ev)
	if err != nil {
		return nil, err // not a nil *Record inside the interface
	}
	return r, nil
}

// BuildWait is Build for callers without a loop of their own: it waits,
// until ctx ends, for the event's topic to be looked up.
func (p *Publisher) BuildWait(ctx context.Context, ev *event.Event) (sink.Record, error) {
	return sink.BuildWhenReady(ctx, p.Build, ev)
}

// Input takes the read loop's items. Records are sent one by one, each
// acknowledged as soon as Kafka stored it, so the ends of source
// transactions and flushes change nothing here. A send on it blocks while
// the producer is full, so select on it alongside the caller's other
// duties.
func (p *Publisher) Input() chan<- sink.Item { return p.input }

// Send hands a record to the producer, waiting while it is full, until ctx
// ends. It is Input for callers without a loop of their own.
func (p *Publisher) Send(ctx context.Context, r sink.Record) error {
	select {
	case p.input <- sink.Item{Record: r}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Outcomes delivers every sent record's ack or failure, in the order the
// producer reports them. It is closed once Close has drained the producer.
func (p *Publisher) Outcomes() <-chan sink.Outcome { return p.outcomes }

// Retries is how many times the producer has backed off to retry a record
// since it was created.
func (p *Publisher) Retries() int64 { return p.retries.Load() }

// forward feeds the records of Input to the producer: sarama's input
// channel carries its own message type, and keeping it out of the caller's
// hands lets another sink stand in for this one.
func (p *Publisher) forward() {
	defer p.workers.Done()
	defer p.producer.AsyncClose()
	in := p.producer.Input()
	for it := range p.input {
		if it.Record != nil {
			in <- &it.Record.(*Record).msg
		}
	}
}

// batchBytes is the batch size the producer builds.
func (c Config) batchBytes() int {
	if c.BatchLimit > 0 && c.BatchLimit < c.MaxMessageBytes {
		return c.BatchLimit
	}
	return c.MaxMessageBytes
}

// drainOutcomes passes each ack and failure to Outcomes until the producer
// closes both channels. Once Close is called they are dropped: nobody
// needs them, and what they concern is re-delivered anyway.
func (p *Publisher) drainOutcomes() {
	defer p.workers.Done()
	defer close(p.outcomes)
	successes, failures := p.producer.Successes(), p.producer.Errors()
	var handOverUntil time.Time
	for successes != nil || failures != nil {
		var o sink.Outcome
		select {
		case msg, ok := <-successes:
			if !ok {
				successes = nil
				continue
			}
			o.Delivery = delivery(msg)
		case perr, ok := <-failures:
			if !ok {
				failures = nil
				continue
			}
			o.Delivery = delivery(perr.Msg)
			r := perr.Msg.Metadata.(*Record)
			var local sarama.ConfigurationError
			if errors.As(perr.Err, &local) {
				o.Partition = -1 // refused by sarama before it chose a partition
			}
			class := Classify(perr.Err)
			err := perr.Err
			if errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
				err = topicGoneError{err}
			}
			o.Err = recordError(class, string(r.rec.EventID), o.Topic, o.Partition, err, r)
			if class != sink.ClassPermanent && p.cfg.SeverOnFailure {
				p.sever()
			}
		}
		p.topics.spans.end(&o)
		select {
		case p.outcomes <- o:
			continue
		case <-p.quit:
		}
		// Closing: a caller may still read (to count failures that may
		// break order), so keep handing outcomes over for a moment before
		// dropping them for a caller that stopped reading.
		if handOverUntil.IsZero() {
			handOverUntil = time.Now().Add(time.Second)
		}
		if wait := time.Until(handOverUntil); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case p.outcomes <- o:
			case <-t.C:
			}
			t.Stop()
		}
	}
}

// sever cuts the producer off from the brokers at its first failure that
// is not a refusal of the record itself: the caller abandons this sink
// and re-sends from its confirmed position then, so nothing more of it may
// reach Kafka. sarama goes on after a record it gave up on: it moves the
// idempotent producer to a new epoch, whose sequence numbers the broker
// accepts afresh, and sends the records queued behind the failed one. Over
// a link that came back (a black hole healed, a leader found again) those
// later records were appended before the failed one was sent again, and an
// aggregate's events reached its partition out of order. Closing the
// client fails everything still queued instead.
func (p *Publisher) sever() {
	p.severing.Do(func() {
		p.log.Warn().Msg("kafka producer failed: its connections are closed so that nothing queued behind the failed record reaches Kafka before it; the relay sends again from its confirmed position")
		go p.adminClosing.Do(func() { p.admin.Close() })
	})
}

// failedDelivery describes a record reported failed without reading what
// the producer writes into its message (partition, offset): a sink that
// gave up waiting may report a record the producer still holds.
func failedDelivery(r *Record) sink.Delivery {
	return sink.Delivery{Txn: r.txn, CommitTime: r.commitTime, Bytes: r.Size(), Topic: r.msg.Topic, Partition: -1, Offset: -1, At: time.Now(), Record: r}
}

func delivery(msg *sarama.ProducerMessage) sink.Delivery {
	r := msg.Metadata.(*Record)
	return sink.Delivery{
		Txn: r.txn, CommitTime: r.commitTime, Bytes: r.Size(),
		Topic: msg.Topic, Partition: msg.Partition, Offset: msg.Offset, At: time.Now(), Record: r,
	}
}

// Close stops taking records, flushes what is in flight for at most
// timeout, then shuts the producer down. Outcomes not yet reported when
// Close is called are dropped, so read what you wait for first: nothing
// needs to read Outcomes for Close to return. It must not be called while
// a send on Input may still happen.
func (p *Publisher) Close(timeout time.Duration) error {
	p.closing.Do(func() {
		close(p.quit)
		close(p.input)
		p.topics.stop()
	})
	drained := make(chan struct{})
	go func() {
		p.workers.Wait()
		p.topics.wait()
		p.topics.spans.abandon()
		close(drained)
	}()
	var err error
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-drained:
	case <-timer.C:
		// A broker that never answers must not hang shutdown. What is still
		// in flight was never confirmed, so it is re-delivered later.
		err = fmt.Errorf("close kafka producer: gave up after %s with records in flight", timeout)
	}
	// Once: sarama's client panics on a second close, and a caller that
	// abandons a sink may close it from two goroutines.
	p.adminClosing.Do(func() { p.admin.Close() })
	return err
}
