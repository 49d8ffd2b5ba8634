package publisher

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/sink"
)

// Kafka makes the sinks and the progress store of one Kafka configuration,
// and keeps what its sinks share across sessions: the events Kafka refused
// inside a transaction (PoisonMemory). The relay and the poller take it as
// their sink factory; they know nothing else of Kafka.
type Kafka struct {
	cfg    Config
	log    zerolog.Logger
	poison *PoisonMemory
}

// NewKafka returns the factory of a validated configuration.
func NewKafka(cfg Config, log zerolog.Logger) *Kafka {
	return &Kafka{cfg: cfg, log: log, poison: NewPoisonMemory(0)}
}

// withBatchLimit is the configuration for a producer whose batches are at
// most batchLimit bytes (0: as configured).
func (k *Kafka) withBatchLimit(batchLimit int) Config {
	cfg := k.cfg
	cfg.BatchLimit = batchLimit
	return cfg
}

// New makes an at-least-once sink whose batches are at most batchLimit
// bytes (0: --kafka-max-message-bytes). Its callers (the relay's stream,
// reconcile's republish, quarantine replay) abandon it at its first
// failure, so it is cut off from the brokers then (SeverOnFailure).
func (k *Kafka) New(batchLimit int) (sink.Sink, error) {
	cfg := k.withBatchLimit(batchLimit)
	cfg.SeverOnFailure = true
	p, err := New(cfg, k.log)
	if err != nil {
		return nil, err // not a nil *Publisher inside the interface
	}
	return p, nil
}

// NewTransactional makes an exactly-once sink, which fences older ones
// with the same ID.
func (k *Kafka) NewTransactional(batchLimit int, t sink.Transactional) (sink.Sink, error) {
	tcfg := DefaultTxnConfig()
	tcfg.TransactionalID, tcfg.Interval = t.ID, t.Interval
	if t.BatchEvents > 0 {
		tcfg.BatchEvents = min(tcfg.BatchEvents, t.BatchEvents)
	}
	if t.BatchBytes > 0 {
		tcfg.BatchBytes = min(tcfg.BatchBytes, t.BatchBytes)
	}
	tcfg.Poison = k.poison
	s, err := NewTxnSink(k.withBatchLimit(batchLimit), tcfg, k.log)
	if err != nil {
		return nil, err
	}
	return s, nil
}

// boundedRetries is a bounded sink's retries of a record: one. Retrying
// then belongs to its caller, per event, with backoff and a bound on
// attempts.
const boundedRetries = 1

// NewBounded makes an at-least-once sink that reports every record within
// Bound: it retries a record once, not for as long as an outage lasts.
// abandoned: the caller drops it at its first failure (SeverOnFailure).
func (k *Kafka) NewBounded(batchLimit int, abandoned bool) (sink.Sink, error) {
	cfg := k.withBatchLimit(batchLimit)
	cfg.RetryMax = boundedRetries
	cfg.SeverOnFailure = abandoned
	p, err := New(cfg, k.log)
	if err != nil {
		return nil, err
	}
	return p, nil
}

// Bound is the longest a bounded sink takes to report a record, each try
// waiting at most --kafka-timeout with a backoff in between, and how it is
// made of the settings, for an error that names them.
func (k *Kafka) Bound() (time.Duration, string) {
	bound := (boundedRetries+1)*k.cfg.Timeout + k.cfg.RetryBackoffMax
	return bound, fmt.Sprintf("%d x --kafka-timeout %s + --kafka-retry-backoff-max %s", boundedRetries+1, k.cfg.Timeout, k.cfg.RetryBackoffMax)
}

// MaxMessageBytes is the largest record, and batch, the sinks build.
func (k *Kafka) MaxMessageBytes() int { return k.cfg.MaxMessageBytes }

// Brokers are where the sinks connect, for the operator.
func (k *Kafka) Brokers() []string { return k.cfg.Brokers }

// TopicTemplate is --topic.
func (k *Kafka) TopicTemplate() string { return k.cfg.TopicTemplate }

// CanName reports whether the topic template can route an event to topic.
func (k *Kafka) CanName(topic string) (bool, error) {
	return TemplateCanName(k.cfg.TopicTemplate, topic)
}

// Check connects to the brokers once: the relay asks before it makes a
// slot, which would hold WAL with no relay to read it if Kafka then
// refused.
func (k *Kafka) Check() error {
	client, err := NewReadClient(k.cfg)
	if err != nil {
		return err
	}
	return client.Close()
}

// OpenProgress opens the progress topic; create makes it when missing.
func (k *Kafka) OpenProgress(ctx context.Context, topic string, create bool) (progress.Store, error) {
	sc, err := ClientConfig(k.cfg)
	if err != nil {
		return nil, err
	}
	open := OpenExistingProgress
	if create {
		open = OpenProgress
	}
	store, err := open(ctx, k.cfg.Brokers, sc, topic)
	if errors.Is(err, progress.ErrConnect) {
		return nil, ConnectError(k.cfg, err)
	}
	if err != nil {
		return nil, err // not a nil *ProgressStore inside the interface
	}
	return store, nil
}

// ReadProgress reads key's record from the progress topic, creating
// nothing, all within --kafka-timeout: some of the client's waits take no
// context, so a one-shot command gives up on them at the deadline.
func (k *Kafka) ReadProgress(ctx context.Context, topic string, key []byte) (rec progress.Record, found bool, err error) {
	type latest struct {
		rec   progress.Record
		found bool
	}
	ctx, cancel := context.WithTimeout(ctx, k.cfg.Timeout)
	defer cancel()
	read, err := Within(ctx, k.cfg, "read the progress record from topic "+topic, func() (latest, error) {
		store, err := k.OpenProgress(ctx, topic, false)
		if err != nil {
			return latest{}, err
		}
		defer store.Close()
		rec, found, err := store.Latest(ctx, key)
		return latest{rec, found}, err
	}, func(latest) {})
	return read.rec, read.found, err
}

// ConnectWithin makes a sink with make, giving up once --kafka-timeout has
// passed or ctx ended, for a one-shot command.
func (k *Kafka) ConnectWithin(ctx context.Context, make func() (sink.Sink, error)) (sink.Sink, error) {
	return Within(ctx, k.cfg, "connect to Kafka", make, func(s sink.Sink) { s.Close(time.Second) })
}
