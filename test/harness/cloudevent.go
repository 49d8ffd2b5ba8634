package harness

import (
	"context"
	"fmt"

	"github.com/IBM/sarama"
	kafka_sarama "github.com/cloudevents/sdk-go/protocol/kafka_sarama/v2"
	"github.com/cloudevents/sdk-go/v2/binding"
	cloudevents "github.com/cloudevents/sdk-go/v2/event"
)

// CloudEvent hands a consumed record to the official CloudEvents SDK's
// Kafka binding, as a sarama consumer message (the binding's own input),
// and lets the SDK build and validate the event: the independent reader
// of the relay's CloudEvents records. It also returns the binding's
// reading of the record's mode (binary or structured).
func CloudEvent(r Record) (*cloudevents.Event, binding.Encoding, error) {
	cm := &sarama.ConsumerMessage{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value, Timestamp: r.Timestamp}
	for i, k := range r.HeaderKeys {
		cm.Headers = append(cm.Headers, &sarama.RecordHeader{Key: []byte(k), Value: r.HeaderValues[i]})
	}
	msg := kafka_sarama.NewMessageFromConsumerMessage(cm)
	encoding := msg.ReadEncoding()
	ev, err := binding.ToEvent(context.Background(), msg)
	if err != nil {
		return nil, encoding, fmt.Errorf("record %s/%d@%d: the SDK cannot read it as a CloudEvent: %w", r.Topic, r.Partition, r.Offset, err)
	}
	if err := ev.Validate(); err != nil {
		return nil, encoding, fmt.Errorf("record %s/%d@%d: the SDK finds the event invalid: %w", r.Topic, r.Partition, r.Offset, err)
	}
	return ev, encoding, nil
}
