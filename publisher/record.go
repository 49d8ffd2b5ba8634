package publisher

import (
	"time"
	"unsafe"

	"github.com/IBM/sarama"

	"github.com/outbox-relay/outbox-relay/event"
)

// recordBatchOverhead is the size of a Kafka v2 record batch header. The
// broker checks max.message.bytes against whole batches, so a record alone
// in its batch needs this much room besides itself.
const recordBatchOverhead = 61

// Record is a built Kafka record, ready to send: the event's record as its
// shape built it, wrapped in the producer's message. Everything the
// producer keeps lives in this one allocation plus the record's one byte
// buffer, which keeps the per-event cost of the hot path at two
// allocations.
type Record struct {
	rec event.Record
	msg sarama.ProducerMessage

	txn        uint64
	commitTime time.Time
	// built is when the exactly-once sink took the event: its Kafka
	// transaction's interval runs from its oldest record's.
	built time.Time
	// size is the encoded size (see Size), and pos the record's place in
	// its Kafka transaction (exactly-once). Both fit an int32, and the
	// eight bytes saved keep a Record with its allocation header within
	// a 768-byte size class instead of 896.
	size, pos int32
}

// Size is the record's encoded size in bytes, as Kafka counts it.
func (r *Record) Size() int { return int(r.size) }

// Topic is the record's topic.
func (r *Record) Topic() string { return r.msg.Topic }

// EventID is the event_id of the row the record was built from.
func (r *Record) EventID() string { return string(r.rec.EventID) }

// Key is the record's key, the aggregate ID.
func (r *Record) Key() []byte { return r.rec.Key }

// Value is the record's value, the payload.
func (r *Record) Value() []byte { return r.rec.Value }

// Header returns the value of the named header, or nil.
func (r *Record) Header(name string) []byte { return r.rec.Header(name) }

// Shaped is the record as the event's shape built it, before it was
// wrapped for the producer: what the quarantine table keeps of a record
// Kafka refused.
func (r *Record) Shaped() *event.Record { return &r.rec }

// keyEncoder and valueEncoder are sarama.Encoders of a record's key and
// value. They are the *Record itself, converted, so msg.Key takes no
// allocation (as a []byte conversion to sarama.ByteEncoder would) and no
// room in the record.
type (
	keyEncoder   Record
	valueEncoder Record
)

func (e *keyEncoder) Encode() ([]byte, error)   { return e.rec.Key, nil }
func (e *keyEncoder) Length() int               { return len(e.rec.Key) }
func (e *valueEncoder) Encode() ([]byte, error) { return e.rec.Value, nil }
func (e *valueEncoder) Length() int             { return len(e.rec.Value) }

// BuildRecord builds an event's record for a topic the caller resolved,
// without the topic lookup and size checks of Publisher.Build, which needs
// a broker. Tests outside this package use it: the relay's fake sink, and
// outbox's check that the relay can build every row the writer writes.
func BuildRecord(ev *event.Event, topic string) (*Record, error) { return build(ev, topic) }

// Txn is the transaction the record's event belongs to, as the event said.
func (r *Record) Txn() uint64 { return r.txn }

// build builds the record in the shape the event's layout asks for, and
// wraps it for the producer.
func build(ev *event.Event, topic string) (*Record, error) {
	r := &Record{txn: ev.Txn, commitTime: ev.CommitTime}
	if err := event.Build(ev, &r.rec); err != nil {
		return nil, err
	}
	r.msg = sarama.ProducerMessage{
		Topic: topic,
		// -1 until sarama picks the partition, so a record refused before
		// that is not taken for one that reached partition 0.
		Partition: -1,
		Key:       (*keyEncoder)(r),
		Value:     (*valueEncoder)(r),
		Headers:   saramaHeaders(r.rec.Headers),
		Metadata:  r,
	}
	r.size = int32(r.msg.ByteSize(2))
	return r, nil
}

// The conversion compiles only while sarama.RecordHeader and event.Header
// are the same struct (a Key and a Value []byte, in that order), which is
// what makes saramaHeaders sound.
var _ = sarama.RecordHeader(event.Header{})

// saramaHeaders is the shape's headers as sarama's type, in place. A copy
// would cost a second header array in every record, a third more memory
// per event on the hot path, for two types that are the same struct.
func saramaHeaders(h []event.Header) []sarama.RecordHeader {
	return unsafe.Slice((*sarama.RecordHeader)(unsafe.Pointer(unsafe.SliceData(h))), len(h))
}
