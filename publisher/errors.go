package publisher

import (
	"errors"
	"fmt"

	"github.com/IBM/sarama"
)

// Class says what a failed record needs.
type Class string

const (
	// ClassRetriable: the broker may accept the record later. The caller
	// re-streams from its confirmed position; the slot holds the events.
	ClassRetriable Class = "retriable"
	// ClassProducer: the producer's idempotence state is broken (sequence
	// or epoch errors). The caller makes a new producer and re-streams.
	ClassProducer Class = "producer"
	// ClassPermanent: Kafka will never accept this record as it is.
	ClassPermanent Class = "permanent"
)

// Error is the failure of one record, naming the event and where it went.
type Error struct {
	Class     Class
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
	return fmt.Sprintf("kafka %s error for event %s, %s: %v; %s", e.Class, e.EventID, where, e.Err, e.Advice())
}

func (e *Error) Unwrap() error { return e.Err }

// Advice tells the operator what to do about the error.
func (e *Error) Advice() string {
	switch {
	case errors.Is(e.Err, sarama.ErrMessageSizeTooLarge):
		return "raise the topic's max.message.bytes (and --kafka-max-message-bytes), or shrink the event"
	case errors.Is(e.Err, sarama.ErrUnknownTopicOrPartition):
		return "create the topic, enable auto.create.topics.enable on the brokers, or fix --topic"
	case errors.Is(e.Err, sarama.ErrInvalidTopic), errors.Is(e.Err, errInvalidTopicName):
		return "fix --topic or the row's aggregate_type/event_type so the topic name is valid"
	case errors.Is(e.Err, sarama.ErrTopicAuthorizationFailed), errors.Is(e.Err, sarama.ErrClusterAuthorizationFailed):
		return "grant the relay's Kafka principal Write and Describe on the topic"
	case e.Class == ClassPermanent:
		return "fix the row or the topic; the relay will not skip the event"
	}
	return "the relay re-streams from its confirmed position"
}

// errInvalidTopicName marks a topic name that Kafka would refuse.
var errInvalidTopicName = errors.New("invalid topic name")

// Classify sorts a producer error into the action it needs.
func Classify(err error) Class {
	var kerr sarama.KError
	if errors.As(err, &kerr) {
		switch kerr {
		case sarama.ErrMessageSizeTooLarge, sarama.ErrInvalidTopic, sarama.ErrTopicAuthorizationFailed,
			sarama.ErrClusterAuthorizationFailed, sarama.ErrInvalidRecord,
			sarama.ErrUnknownTopicOrPartition, sarama.ErrPolicyViolation:
			return ClassPermanent
		case sarama.ErrOutOfOrderSequenceNumber, sarama.ErrInvalidProducerEpoch, sarama.ErrUnknownProducerID,
			sarama.ErrDuplicateSequenceNumber, sarama.ErrProducerFenced, sarama.ErrInvalidProducerIDMapping:
			return ClassProducer
		}
		return ClassRetriable
	}
	var cerr sarama.ConfigurationError
	if errors.As(err, &cerr) {
		// sarama's own Producer.MaxMessageBytes check, made before sending.
		return ClassPermanent
	}
	if errors.Is(err, errInvalidTopicName) {
		return ClassPermanent
	}
	return ClassRetriable
}
