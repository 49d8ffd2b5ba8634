package publisher

import (
	"errors"
	"fmt"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"

	"github.com/outbox-relay/outbox-relay/sink"
)

// recordError is the failure of one record as the engine gets it: its
// cause carries what to do about it (kafkaAdvice), and whether re-delivering
// it may break its partition's order.
func recordError(class sink.Class, eventID, topic string, partition int32, err error, r *Record) *sink.Error {
	e := &sink.Error{Class: class, EventID: eventID, Topic: topic, Partition: partition, Err: err,
		OrderMayBreak: orderMayBreak(partition, err)}
	if advice := kafkaAdvice(err); advice != "" {
		e.Err = sink.AdvisedError(err, advice)
	}
	if r != nil { // a nil *Record would make a non-nil interface
		e.Record = r
	}
	return e
}

// kafkaAdvice tells the operator what to do about a record Kafka or the
// producer refused; "" leaves it to the advice of the error's class.
func kafkaAdvice(err error) string {
	var size *LocalSizeError
	switch {
	case errors.As(err, &size) && size.LoweredTo > 0 && size.Size <= min(size.TopicMax-recordBatchOverhead, size.ProducerMax):
		return "the topic takes it, but the producer's batches were lowered for another topic: replay it on its own (`outbox-relay quarantine replay <event_id>`)"
	case errors.Is(err, sarama.ErrMessageSizeTooLarge), isLocalSize(err):
		return "raise the topic's max.message.bytes (and --kafka-max-message-bytes), or shrink the event"
	case errors.Is(err, sarama.ErrUnknownTopicOrPartition):
		return "create the topic, enable auto.create.topics.enable on the brokers, or fix --topic"
	case errors.Is(err, sarama.ErrInvalidTopic), errors.Is(err, errInvalidTopicName):
		return "fix --topic or the row's aggregate_type/event_type so the topic name is valid"
	case errors.Is(err, sarama.ErrTopicAuthorizationFailed), errors.Is(err, sarama.ErrClusterAuthorizationFailed):
		return "grant the relay's Kafka principal Write and Describe on the topic"
	}
	return ""
}

func isLocalSize(err error) bool {
	var lsErr *LocalSizeError
	return errors.As(err, &lsErr)
}

// topicGoneError is a producer's failure on a topic that no longer exists,
// marked sink.ErrTopicGone so the engine ends the session and the next one
// looks the topic up again (a deleted topic the relay published to is
// waited for, TopicDeletedError). Its message is the producer's.
type topicGoneError struct{ err error }

func (e topicGoneError) Error() string   { return e.err.Error() }
func (e topicGoneError) Unwrap() []error { return []error{e.err, sink.ErrTopicGone} }

// errInvalidTopicName marks a topic name that Kafka would refuse.
var errInvalidTopicName = errors.New("invalid topic name")

// Classify sorts a producer error into the action it needs.
func Classify(err error) sink.Class {
	var kerr sarama.KError
	if errors.As(err, &kerr) {
		switch kerr {
		case sarama.ErrMessageSizeTooLarge, sarama.ErrInvalidTopic, sarama.ErrTopicAuthorizationFailed,
			sarama.ErrClusterAuthorizationFailed, sarama.ErrInvalidRecord,
			sarama.ErrPolicyViolation:
			return sink.ClassPermanent
		case sarama.ErrUnknownTopicOrPartition:
			// A record reaches the producer only once its topic was found
			// (topicResolver), so the topic went away since: deleted, or a
			// broker that lost it. The next session looks it up again and
			// waits if the relay published to it before (TopicDeletedError);
			// quarantined here, its events would be replayed after the ones
			// published once the topic was back.
			return sink.ClassRetriable
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

// orderMayBreak reports whether re-delivering the failed record may put it
// after later records of the same partition: only when it failed once it
// could have been in a produce request, for sarama keeps appending later
// batches of a partition after one failed. A record that never reached a
// partition, or whose failure came from finding a broker (no broker
// reachable, the circuit breaker open) was never sent, and the session ends
// before later records get further than it did.
func orderMayBreak(partition int32, err error) bool {
	if partition < 0 {
		return false
	}
	for _, before := range notSent {
		if errors.Is(err, before) {
			return false
		}
	}
	return !isLocalSize(err)
}

// notSent are failures sarama reports while it looks for the partition's
// leader, before the record is put in a produce request. Broker answers
// such as NOT_LEADER_OR_FOLLOWER are not among them: sarama retries those,
// and when it gives up, later records may already be appended.
var notSent = []error{
	breaker.ErrBreakerOpen, sarama.ErrOutOfBrokers, sarama.ErrNotConnected, sarama.ErrClosedClient,
}
