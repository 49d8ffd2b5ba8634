// Package publisher talks to Kafka. It turns outbox events into Kafka
// records (topic from a template, key = aggregate ID, payload as value,
// standard headers, Java-compatible partitioning), sends them through an
// idempotent sarama producer, and reports every acknowledgement and failure
// with the event's position so the caller can decide what is safe to confirm.
// It knows nothing of WAL or replication slots.
package publisher

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/rs/zerolog"
)

// Config says how to reach Kafka and how to shape records.
type Config struct {
	Brokers       []string
	TopicTemplate string // e.g. "outbox.event.{aggregate_type}"
	Compression   string // none, gzip, snappy, lz4, zstd
	KafkaVersion  string // protocol version to speak, e.g. "3.6.0"
	ClientID      string

	// MaxMessageBytes is the largest batch the producer builds for one
	// partition, and so the largest record it sends. Keep it at or below the
	// smallest max.message.bytes of the target topics.
	MaxMessageBytes int

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
	// the relay is idle between events.
	Linger time.Duration

	Security Security

	// TopicWait is how long a new topic may take to appear (for brokers that
	// create topics on first use) before it counts as missing.
	TopicWait time.Duration
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
		TopicWait:       10 * time.Second,
	}
}

// Delivery is the outcome of one record, handed to the Handler.
type Delivery struct {
	Txn        uint64
	CommitTime time.Time
	Bytes      int
	Topic      string
	Partition  int32
	Offset     int64
}

// Handler receives outcomes. The publisher calls it from one goroutine, in
// the order the producer reports them.
type Handler interface {
	Acked(d Delivery)
	Failed(d Delivery, err *Error)
}

// ErrAuth marks a Kafka authentication or certificate failure. Retrying in
// the same process cannot fix it (credentials are read at start), so the
// relay exits and its supervisor restarts it with what the operator fixed.
var ErrAuth = errors.New("kafka authentication failed")

func authFailure(err error) bool {
	var certErr *tls.CertificateVerificationError
	var unknownCA x509.UnknownAuthorityError
	var hostErr x509.HostnameError
	return errors.Is(err, sarama.ErrSASLAuthenticationFailed) || errors.As(err, &certErr) ||
		errors.As(err, &unknownCA) || errors.As(err, &hostErr)
}

// RetryObserver may be implemented by a Handler that wants to count the
// producer's retries (each is a backoff before a record is sent again).
type RetryObserver interface {
	Retrying()
}

// Publisher owns one sarama producer and the goroutine that drains its
// outcomes. It is built for one stream session: after a failure the caller
// closes it and makes a new one.
type Publisher struct {
	cfg      Config
	log      zerolog.Logger
	topics   *topicTemplate
	client   sarama.Client
	admin    sarama.ClusterAdmin
	producer sarama.AsyncProducer
	handler  Handler
	waiting  Waiting

	known map[string]*topicInfo // read and written only by the sending goroutine
	wait  *time.Timer           // Send's timer, used only by the sending goroutine

	outcomes sync.WaitGroup
}

// topicInfo is what the publisher learned of a topic on first use.
type topicInfo struct {
	name     string
	maxBytes int // the topic's max.message.bytes
}

// Waiting is what the caller must keep doing while the publisher blocks it
// (a full producer, a topic lookup): Do is called every Interval, and an
// error from it ends the wait. The relay keeps its replication connection's
// status updates going this way, so wal_sender_timeout never fires.
type Waiting struct {
	Interval time.Duration
	Do       func() error
}

// New connects to Kafka and starts the producer.
func New(cfg Config, handler Handler, waiting Waiting, log zerolog.Logger) (*Publisher, error) {
	topics, err := parseTopicTemplate(cfg.TopicTemplate)
	if err != nil {
		return nil, err
	}
	sc, err := saramaConfig(cfg)
	if err != nil {
		return nil, err
	}
	if observer, ok := handler.(RetryObserver); ok {
		backoff := sc.Producer.Retry.BackoffFunc
		sc.Producer.Retry.BackoffFunc = func(retries, maxRetries int) time.Duration {
			observer.Retrying()
			return backoff(retries, maxRetries)
		}
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
	p := &Publisher{
		cfg: cfg, log: log, topics: topics,
		client: client, admin: admin, producer: producer, handler: handler, waiting: waiting,
		known: make(map[string]*topicInfo),
	}
	p.outcomes.Add(1)
	go p.drainOutcomes()
	return p, nil
}

func saramaConfig(cfg Config) (*sarama.Config, error) {
	sc := sarama.NewConfig()
	version, err := sarama.ParseKafkaVersion(cfg.KafkaVersion)
	if err != nil {
		return nil, fmt.Errorf("kafka version %q: %w", cfg.KafkaVersion, err)
	}
	sc.Version = version
	sc.ClientID = cfg.ClientID
	sc.MetricRegistry = newDiscardMetrics()
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
		d := 100 * time.Millisecond << min(retries, 6)
		d = min(d, backoffMax)
		return d/2 + rand.N(d/2+1)
	}
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	sc.Producer.Partitioner = newJavaPartitioner
	sc.Producer.MaxMessageBytes = cfg.MaxMessageBytes
	sc.Producer.Flush.Frequency = cfg.Linger
	sc.Metadata.AllowAutoTopicCreation = true
	if err := cfg.Security.apply(sc); err != nil {
		return nil, err
	}
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
// Kafka could never accept the record (bad topic name, too large, malformed
// headers), and with a *BatchLimitError when the topic needs a producer with
// smaller batches. It must be called from one goroutine.
func (p *Publisher) Build(ev *Event) (*Record, error) {
	topic, err := p.topic(ev)
	if err != nil {
		return nil, err
	}
	r, err := build(ev, topic.name)
	if err != nil {
		return nil, &Error{Class: ClassPermanent, EventID: string(ev.EventID), Topic: topic.name, Partition: -1, Err: err}
	}
	if limit := min(topic.maxBytes-recordBatchOverhead, p.cfg.MaxMessageBytes); r.size > limit {
		return nil, &Error{Class: ClassPermanent, EventID: string(ev.EventID), Topic: topic.name, Partition: -1,
			Err: fmt.Errorf("%w: record is %d bytes, the limit is %d (topic max.message.bytes %d, producer %d)",
				sarama.ErrMessageSizeTooLarge, r.size, limit, topic.maxBytes, p.cfg.MaxMessageBytes)}
	}
	return r, nil
}

// Send hands a built record to the producer. While the producer's input is
// full it blocks, doing the caller's Waiting duty. Send is called from one
// goroutine, which lets it reuse one timer: while catching up the input is
// often full, and a new ticker per blocked send was a third of the relay's
// allocations.
func (p *Publisher) Send(ctx context.Context, r *Record) error {
	select {
	case p.producer.Input() <- &r.msg:
		return nil
	default:
	}
	if p.wait == nil {
		p.wait = time.NewTimer(p.waiting.Interval)
	} else {
		p.wait.Reset(p.waiting.Interval)
	}
	for {
		select {
		case p.producer.Input() <- &r.msg:
			p.wait.Stop()
			return nil
		case <-p.wait.C:
			if err := p.waiting.Do(); err != nil {
				return err
			}
			p.wait.Reset(p.waiting.Interval)
		case <-ctx.Done():
			p.wait.Stop()
			return ctx.Err()
		}
	}
}

// topic resolves and, on first use, checks an event's topic.
func (p *Publisher) topic(ev *Event) (*topicInfo, error) {
	var scratch [256]byte
	name := p.topics.appendName(scratch[:0], ev)
	if t, ok := p.known[string(name)]; ok {
		return t, nil
	}
	t, err := p.awaitDiscovery(string(name))
	if err != nil {
		var perm *Error
		if errors.As(err, &perm) {
			perm.EventID = string(ev.EventID)
		}
		return nil, err
	}
	p.known[t.name] = t
	return t, nil
}

// awaitDiscovery runs discover on its own goroutine, doing the caller's
// Waiting duty meanwhile: a slow or unreachable broker can make a topic
// lookup take as long as sarama's metadata retries.
func (p *Publisher) awaitDiscovery(name string) (*topicInfo, error) {
	type result struct {
		topic *topicInfo
		err   error
	}
	done := make(chan result, 1)
	go func() {
		t, err := p.discover(name)
		done <- result{t, err}
	}()
	tick := time.NewTicker(p.waiting.Interval)
	defer tick.Stop()
	for {
		select {
		case r := <-done:
			return r.topic, r.err
		case <-tick.C:
			if err := p.waiting.Do(); err != nil {
				return nil, err
			}
		}
	}
}

// discover checks that a topic exists and learns its max.message.bytes, so
// an oversize record is caught before it is sent. Sent, it would fail its
// whole batch and take innocent neighbours, and their order, down with it.
func (p *Publisher) discover(name string) (*topicInfo, error) {
	if err := validTopicName(name); err != nil {
		return nil, &Error{Class: ClassPermanent, Topic: name, Partition: -1, Err: err}
	}
	deadline := time.Now().Add(p.cfg.TopicWait)
	for {
		err := p.client.RefreshMetadata(name)
		if err == nil {
			_, err = p.client.Partitions(name)
		}
		if err == nil {
			break
		}
		if !errors.Is(err, sarama.ErrUnknownTopicOrPartition) && !errors.Is(err, sarama.ErrLeaderNotAvailable) {
			return nil, fmt.Errorf("look up topic %s: %w", name, err)
		}
		if time.Now().After(deadline) {
			return nil, &Error{Class: ClassPermanent, Topic: name, Partition: -1,
				Err: fmt.Errorf("%w: topic does not exist and the brokers did not create it", sarama.ErrUnknownTopicOrPartition)}
		}
		time.Sleep(200 * time.Millisecond) // the broker is creating the topic; poll its metadata
	}

	t := &topicInfo{name: name, maxBytes: p.cfg.MaxMessageBytes + recordBatchOverhead}
	entries, err := p.admin.DescribeConfig(sarama.ConfigResource{
		Type: sarama.TopicResource, Name: name, ConfigNames: []string{"max.message.bytes"},
	})
	if err != nil {
		p.log.Warn().Err(err).Str("topic", name).
			Msg("could not read the topic's max.message.bytes; grant DescribeConfigs on the topic so oversize records are caught before they are sent")
	}
	for _, e := range entries {
		if e.Name == "max.message.bytes" {
			if v, err := strconv.Atoi(e.Value); err == nil {
				t.maxBytes = v
			}
		}
	}
	if t.maxBytes-recordBatchOverhead < p.cfg.MaxMessageBytes {
		return nil, &BatchLimitError{Topic: name, MaxMessageBytes: t.maxBytes - recordBatchOverhead}
	}
	p.log.Debug().Str("topic", name).Int("max_message_bytes", t.maxBytes).Msg("topic ready")
	return t, nil
}

// BatchLimitError says a topic accepts smaller batches than the producer
// builds. The caller restarts with MaxMessageBytes lowered to the limit;
// otherwise a batch of small records could exceed the topic's limit.
type BatchLimitError struct {
	Topic           string
	MaxMessageBytes int
}

func (e *BatchLimitError) Error() string {
	return fmt.Sprintf("topic %s accepts batches of at most %d bytes; restarting the producer with that limit", e.Topic, e.MaxMessageBytes)
}

// drainOutcomes reports each ack and failure to the handler until the
// producer closes both channels.
func (p *Publisher) drainOutcomes() {
	defer p.outcomes.Done()
	successes, failures := p.producer.Successes(), p.producer.Errors()
	for successes != nil || failures != nil {
		select {
		case msg, ok := <-successes:
			if !ok {
				successes = nil
				continue
			}
			p.handler.Acked(delivery(msg))
		case perr, ok := <-failures:
			if !ok {
				failures = nil
				continue
			}
			d := delivery(perr.Msg)
			r := perr.Msg.Metadata.(*Record)
			var local sarama.ConfigurationError
			if errors.As(perr.Err, &local) {
				d.Partition = -1 // refused by sarama before it chose a partition
			}
			p.handler.Failed(d, &Error{
				Class: Classify(perr.Err), EventID: string(r.eventID),
				Topic: d.Topic, Partition: d.Partition, Err: perr.Err, Record: r,
			})
		}
	}
}

func delivery(msg *sarama.ProducerMessage) Delivery {
	r := msg.Metadata.(*Record)
	return Delivery{
		Txn: r.txn, CommitTime: r.commitTime, Bytes: r.size,
		Topic: msg.Topic, Partition: msg.Partition, Offset: msg.Offset,
	}
}

// Close flushes what is in flight for at most timeout, then shuts the
// producer down. Outcomes that arrive meanwhile still reach the handler.
func (p *Publisher) Close(timeout time.Duration) error {
	p.producer.AsyncClose()
	drained := make(chan struct{})
	go func() {
		p.outcomes.Wait()
		close(drained)
	}()
	var err error
	select {
	case <-drained:
	case <-time.After(timeout):
		// A broker that never answers must not hang shutdown. What is still
		// in flight was never confirmed, so it is re-delivered later; a late
		// outcome may still reach the handler.
		err = fmt.Errorf("close kafka producer: gave up after %s with records in flight", timeout)
	}
	p.admin.Close()
	return err
}
