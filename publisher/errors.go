package publisher

import (
	"errors"
	"fmt"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"

	"github.com/outbox-relay/outbox-relay/sink"
)

// Error is the failure of one record, naming the event and where it went.
// Its message says what failed; Advice says what to do about it, and
// sink.Explain puts the two together where an error reaches the operator.
type Error struct {
	Class     sink.Class
	EventID   string
	Topic     string
	Partition int32 // -1 when the record never reached a partition
	Err       error
	// Record is the failed record, when it was built.
	Record *Record
}

func (e *Error) Error() string {
	where := "topic " + e.Topic
	if e.Partition >= 0 {
		where = fmt.Sprintf("topic %s partition %d", e.Topic, e.Partition)
	}
	return fmt.Sprintf("kafka %s error for event %s, %s: %v", e.Class, e.EventID, where, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }

// Advice tells the operator what to do about the error.
func (e *Error) Advice() string {
	var size *LocalSizeError
	switch {
	case errors.As(e.Err, &size) && size.LoweredTo > 0 && size.Size <= min(size.TopicMax-recordBatchOverhead, size.ProducerMax):
		return "the topic takes it, but the producer's batches were lowered for another topic: replay it on its own (`outbox-relay quarantine replay <event_id>`)"
	case errors.Is(e.Err, sarama.ErrMessageSizeTooLarge), isLocalSize(e.Err):
		return "raise the topic's max.message.bytes (and --kafka-max-message-bytes), or shrink the event"
	case errors.Is(e.Err, sarama.ErrUnknownTopicOrPartition):
		return "create the topic, enable auto.create.topics.enable on the brokers, or fix --topic"
	case errors.Is(e.Err, sarama.ErrInvalidTopic), errors.Is(e.Err, errInvalidTopicName):
		return "fix --topic or the row's aggregate_type/event_type so the topic name is valid"
	case errors.Is(e.Err, sarama.ErrTopicAuthorizationFailed), errors.Is(e.Err, sarama.ErrClusterAuthorizationFailed):
		return "grant the relay's Kafka principal Write and Describe on the topic"
	case errors.Is(e.Err, ErrUnmappedRow):
		return "PostgreSQL decodes this row with the columns of its time, so no ALTER TABLE lets the stream pass it: it goes to the quarantine table (under --on-permanent-error halt, start once with --on-permanent-error quarantine to set it aside). " +
			"The row is still in the outbox table: fill the missing values in the quarantine table from it (UPDATE ... FROM the outbox table, by event_id), then run `outbox-relay quarantine replay`"
	case errors.Is(e.Err, ErrBadContent):
		return "a message exists only in the WAL, so the quarantine table's row is its only copy (raw holds the content as it was emitted; under --on-permanent-error halt, start once with --on-permanent-error quarantine to set it aside). " +
			"Fix the writer that emitted it; to deliver this event, set the row's columns from raw and clear content_problem (UPDATE on the quarantine table, by event_id), then run `outbox-relay quarantine replay`"
	case e.Class == sink.ClassPermanent:
		return "fix the row or the topic, then `outbox-relay quarantine replay` it; the event is kept in the quarantine table (or, under --on-permanent-error halt, the relay stops on it), never dropped"
	}
	return "the relay re-streams from its confirmed position"
}

func isLocalSize(err error) bool {
	var lsErr *LocalSizeError
	return errors.As(err, &lsErr)
}

// errInvalidTopicName marks a topic name that Kafka would refuse.
var errInvalidTopicName = errors.New("invalid topic name")

// Classify sorts a producer error into the action it needs.
func Classify(err error) sink.Class {
	var kerr sarama.KError
	if errors.As(err, &kerr) {
		switch kerr {
		case sarama.ErrMessageSizeTooLarge, sarama.ErrInvalidTopic, sarama.ErrTopicAuthorizationFailed,
			sarama.ErrClusterAuthorizationFailed, sarama.ErrInvalidRecord,
			sarama.ErrUnknownTopicOrPartition, sarama.ErrPolicyViolation:
			return sink.ClassPermanent
		case sarama.ErrOutOfOrderSequenceNumber, sarama.ErrInvalidProducerEpoch, sarama.ErrUnknownProducerID,
			sarama.ErrDuplicateSequenceNumber, sarama.ErrProducerFenced, sarama.ErrInvalidProducerIDMapping:
			return sink.ClassProducer
		}
		return sink.ClassRetriable
	}
	var cerr sarama.ConfigurationError
	if errors.As(err, &cerr) {
		// sarama's own Producer.MaxMessageBytes check, made before sending.
		return sink.ClassPermanent
	}
	if errors.Is(err, errInvalidTopicName) || isLocalSize(err) {
		return sink.ClassPermanent
	}
	return sink.ClassRetriable
}

// LocalSizeError is a record the publisher refused before sending it: it is
// larger than the topic or the producer accepts. No broker saw it.
type LocalSizeError struct {
	Size, Limit, TopicMax int
	// ProducerMax is --kafka-max-message-bytes as given; LoweredTo, when
	// set, is the smaller batch size the producer uses since another topic
	// took only that.
	ProducerMax, LoweredTo int
}

func (e *LocalSizeError) Error() string {
	lowered := ""
	if e.LoweredTo > 0 {
		lowered = fmt.Sprintf(", lowered to %d for a topic that takes smaller batches", e.LoweredTo)
	}
	return fmt.Sprintf("record too large: %d bytes, over the limit of %d the relay checks before sending, so no broker saw it (topic max.message.bytes %d, producer --kafka-max-message-bytes %d%s)",
		e.Size, e.Limit, e.TopicMax, e.ProducerMax, lowered)
}

// OrderMayBreak reports whether re-delivering the failed record may put it
// after later records of the same partition: only when it failed once it
// could have been in a produce request, for sarama keeps appending later
// batches of a partition after one failed. A record that never reached a
// partition, or whose failure came from finding a broker (no broker
// reachable, the circuit breaker open) was never sent, and the session ends
// before later records get further than it did.
func (e *Error) OrderMayBreak() bool {
	if e.Partition < 0 {
		return false
	}
	for _, before := range notSent {
		if errors.Is(e.Err, before) {
			return false
		}
	}
	return !isLocalSize(e.Err)
}

// notSent are failures sarama reports while it looks for the partition's
// leader, before the record is put in a produce request. Broker answers
// such as NOT_LEADER_OR_FOLLOWER are not among them: sarama retries those,
// and when it gives up, later records may already be appended.
var notSent = []error{
	breaker.ErrBreakerOpen, sarama.ErrOutOfBrokers, sarama.ErrNotConnected, sarama.ErrClosedClient,
}
