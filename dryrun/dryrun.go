// Package dryrun is the sink of `run --dry-run`: it prints each record the
// relay would publish, as one JSON line, and sends nothing anywhere. The
// events the relay would quarantine are printed too, with why, instead of
// being written to the quarantine table. A user checks a configuration
// (topics, keys, headers, record format) against production data with it.
package dryrun

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// Printer writes the dry run's lines to one writer, from any goroutine. It
// makes the sinks of the relay's sessions and takes the events they would
// quarantine.
type Printer struct {
	topic     func(*event.Event) string
	partition func(topic string, key []byte) (int32, error)

	mu  sync.Mutex
	out io.Writer
	enc *json.Encoder
}

// NewPrinter prints to out. topic names an event's topic as the relay
// would; partition, when not nil, says which partition a key goes to (the
// Kafka sink's partitioner, with the topic's partition count looked up
// read-only).
func NewPrinter(out io.Writer, topic func(*event.Event) string, partition func(topic string, key []byte) (int32, error)) *Printer {
	enc := json.NewEncoder(out)
	enc.SetEscapeHTML(false)
	return &Printer{topic: topic, partition: partition, out: out, enc: enc}
}

// Line is one printed record, or one event the relay would quarantine
// (Quarantined set, with Error saying why). Bytes that are not UTF-8 are
// printed in base64, in the field of the same name with _base64 after it,
// so what is printed is exactly what would be sent.
type Line struct {
	Topic          string  `json:"topic"`
	Partition      *int32  `json:"partition,omitempty"`
	PartitionError string  `json:"partition_error,omitempty"`
	EventID        string  `json:"event_id,omitempty"`
	Key            *string `json:"key,omitempty"`
	KeyBase64      *string `json:"key_base64,omitempty"`
	Headers        []Field `json:"headers,omitempty"`
	Value          *string `json:"value,omitempty"`
	ValueBase64    *string `json:"value_base64,omitempty"`
	Quarantined    bool    `json:"quarantined,omitempty"`
	Error          string  `json:"error,omitempty"`
	ContentProblem string  `json:"content_problem,omitempty"`
	Class          string  `json:"class,omitempty"`
}

// Field is one header.
type Field struct {
	Key         string  `json:"key"`
	Value       *string `json:"value,omitempty"`
	ValueBase64 *string `json:"value_base64,omitempty"`
}

// text is b for a JSON line: as text when it is UTF-8, else in base64;
// both nil for a nil b (a null value).
func text(b []byte) (plain, b64 *string) {
	if b == nil {
		return nil, nil
	}
	s := string(b)
	if utf8.ValidString(s) {
		return &s, nil
	}
	enc := base64.StdEncoding.EncodeToString(b)
	return nil, &enc
}

func (p *Printer) print(l *Line) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.enc.Encode(l); err != nil {
		return fmt.Errorf("print the dry run's record: %w", err)
	}
	return nil
}

// record is the line of a record.
func (p *Printer) record(r *Record) *Line {
	l := &Line{Topic: r.topic, EventID: string(r.rec.EventID)}
	l.Key, l.KeyBase64 = text(r.rec.Key)
	l.Value, l.ValueBase64 = text(r.rec.Value)
	for _, h := range r.rec.Headers {
		f := Field{Key: string(h.Key)}
		f.Value, f.ValueBase64 = text(h.Value)
		l.Headers = append(l.Headers, f)
	}
	if p.partition != nil {
		if n, err := p.partition(r.topic, r.rec.Key); err != nil {
			l.PartitionError = err.Error()
		} else {
			l.Partition = &n
		}
	}
	return l
}

// Put prints an event the relay would quarantine, in place of storing it.
func (p *Printer) Put(_ context.Context, q store.Quarantined) error {
	l := &Line{Topic: q.Topic, EventID: q.EventID, Quarantined: true, Error: q.ErrorMessage, Class: q.ErrorClass, ContentProblem: q.ContentProblem}
	l.Key, l.KeyBase64 = text([]byte(q.AggregateID))
	if !q.PayloadNull {
		l.Value, l.ValueBase64 = text([]byte(q.Payload))
	}
	return p.print(l)
}

// NewSink makes a sink that prints every record sent to it and reports it
// acknowledged. It never fails, so the relay's session goes on as it would
// with Kafka taking everything.
func (p *Printer) NewSink() (sink.Sink, error) {
	s := &Sink{p: p, in: make(chan sink.Item), outcomes: make(chan sink.Outcome, 1024), done: make(chan struct{})}
	go s.run()
	return s, nil
}

// Sink is one session's printing sink.
type Sink struct {
	p        *Printer
	in       chan sink.Item
	outcomes chan sink.Outcome
	done     chan struct{}
	closing  sync.Once
}

// Record is a record of the dry run: the event's record as its shape
// built it, and its topic.
type Record struct {
	rec        event.Record
	topic      string
	txn        uint64
	commitTime time.Time
}

func (r *Record) Topic() string         { return r.topic }
func (r *Record) EventID() string       { return string(r.rec.EventID) }
func (r *Record) Size() int             { return len(r.rec.Key) + len(r.rec.Value) }
func (r *Record) Txn() uint64           { return r.txn }
func (r *Record) Shaped() *event.Record { return &r.rec }

// Build builds the event's record as the Kafka sink would, with no broker.
func (s *Sink) Build(ev *event.Event) (sink.Record, error) {
	r := &Record{topic: s.p.topic(ev), txn: ev.Txn, commitTime: ev.CommitTime}
	if err := event.Build(ev, &r.rec); err != nil {
		return nil, &sink.Error{Class: sink.ClassPermanent, EventID: string(ev.EventID), Topic: r.topic, Partition: -1, Err: err}
	}
	return r, nil
}

func (s *Sink) Input() chan<- sink.Item       { return s.in }
func (s *Sink) Outcomes() <-chan sink.Outcome { return s.outcomes }
func (s *Sink) Retries() int64                { return 0 }

// run prints each record in the order it came and reports it acked.
// Transaction ends and flushes mean nothing here: nothing is held.
func (s *Sink) run() {
	defer close(s.done)
	defer close(s.outcomes)
	for it := range s.in {
		r, ok := it.Record.(*Record)
		if !ok {
			continue
		}
		d := sink.Delivery{Txn: r.txn, CommitTime: r.commitTime, Bytes: r.Size(), Topic: r.topic, Partition: -1, Offset: -1, Record: r}
		line := s.p.record(r)
		if line.Partition != nil {
			d.Partition = *line.Partition
		}
		o := sink.Outcome{Delivery: d}
		if err := s.p.print(line); err != nil {
			// stdout closed (a pipe's reader gone): the record was not shown.
			o.Err = &sink.Error{Class: sink.ClassRetriable, EventID: r.EventID(), Topic: r.topic, Partition: -1, Err: err, Record: r}
		}
		o.At = time.Now()
		s.outcomes <- o
	}
}

// Close stops taking records and waits, for at most timeout, until every
// record taken was printed.
func (s *Sink) Close(timeout time.Duration) error {
	s.closing.Do(func() { close(s.in) })
	go func() {
		// Outcomes no one reads any more must not hold the printer.
		for range s.outcomes {
		}
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-s.done:
		return nil
	case <-t.C:
		return fmt.Errorf("the dry run's printer did not finish within %s", timeout)
	}
}
