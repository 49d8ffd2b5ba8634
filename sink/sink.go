// Package sink is what the engine knows of where events go, whatever the
// system behind it: what a failed record needs (Class), the failures that
// need the operator (ErrAuth) or a smaller batch (BatchLimitError), and
// how an error that carries advice reads (Explain). It imports nothing of
// Kafka: publisher implements the Kafka sink and returns these.
package sink

import (
	"errors"
	"fmt"
	"time"
)

// Class says what a failed record needs.
type Class string

const (
	// ClassRetriable: the broker may accept the record later. The caller
	// re-streams from its confirmed position; the source holds the events.
	ClassRetriable Class = "retriable"
	// ClassProducer: the producer's idempotence state is broken (sequence
	// or epoch errors). The caller makes a new producer and re-streams.
	ClassProducer Class = "producer"
	// ClassPermanent: the broker will never accept this record as it is.
	ClassPermanent Class = "permanent"
)

// Classes are every class, for series that exist before the first error.
func Classes() []Class { return []Class{ClassRetriable, ClassProducer, ClassPermanent} }

// ErrAuth marks an authentication or certificate failure. Retrying in the
// same process cannot fix it (credentials are read at start), so the relay
// exits and its supervisor restarts it with what the operator fixed.
var ErrAuth = errors.New("kafka authentication failed")

// ErrTopicPartitions marks an event topic whose partitions no longer
// hold its keys' partitions: it has fewer than its keys are mapped by
// (deleted and created again). Retrying cannot fix it; the operator
// decides (docs/partitions.md).
var ErrTopicPartitions = errors.New("event topic has fewer partitions than its keys are mapped by")

// ErrTopicGone marks a record whose event topic no longer exists on the
// brokers (deleted since the session looked it up). The session ends, and
// the next one looks the topic up again: one the relay published to before
// is waited for, its events held in the source, never quarantined.
var ErrTopicGone = errors.New("event topic no longer exists on the brokers")

// BatchLimitError says a topic accepts smaller batches than the producer
// builds. The caller restarts with BatchLimit lowered to the limit;
// otherwise a batch of small records could exceed the topic's limit.
type BatchLimitError struct {
	Topic           string
	MaxMessageBytes int
}

func (e *BatchLimitError) Error() string {
	return fmt.Sprintf("topic %s accepts batches of at most %d bytes; restarting the producer with that limit", e.Topic, e.MaxMessageBytes)
}

// Advised is an error that says what the operator should do about it.
type Advised interface {
	error
	Advice() string
}

// Explain is err as the operator reads it: its message, then the advice of
// the Advised error it wraps, if any, once. The advice is not part of
// Error(), so an error wrapped on its way up (fmt.Errorf("...: %w", err),
// or one inside another) does not repeat it; what shows an error to the
// operator (an exit message, a command's output) calls Explain, and a log
// line can carry Advice in a field of its own instead.
func Explain(err error) string {
	if err == nil {
		return ""
	}
	var advised Advised
	if !errors.As(err, &advised) {
		return err.Error()
	}
	return err.Error() + "; " + advised.Advice()
}

// ErrFenced means another producer with the same transactional id started:
// this one must never commit again. The relay stops, or goes back to
// waiting as a standby; it must not retry with the same producer.
var ErrFenced = errors.New("kafka producer fenced by a newer producer with the same transactional id")

// ClassFenced is the class of the failures reported after the producer was
// fenced. Unlike the other classes it is fatal to the producer's session and
// to the instance: another instance now owns the transactional id.
const ClassFenced Class = "fenced"

// DefaultTransactionInterval is how long a transaction stays open by
// default (--transaction-interval).
const DefaultTransactionInterval = 100 * time.Millisecond

// Transactional shapes a sink that writes transactions (exactly-once).
type Transactional struct {
	// ID identifies the producer across restarts: a newer sink with the
	// same ID fences the older (ErrFenced).
	ID string
	// Interval is how long a transaction stays open before it commits at
	// the next source transaction's end.
	Interval time.Duration
	// BatchEvents and BatchBytes end a transaction at the next source
	// transaction's end once it holds this much, or the sink's own batch
	// if that is smaller; zero is the sink's own.
	BatchEvents, BatchBytes int
}
