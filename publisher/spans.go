package publisher

import (
	"errors"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/tracing"
)

// spanTable holds the trace spans of a sink's records in flight, from
// Build to the record's outcome. A Record has no room for one (it fills a
// 768-byte size class exactly), and a table costs only when tracing is on:
// a sink without Config.Tracing has none.
type spanTable struct {
	mu    sync.Mutex
	spans map[*Record]*tracing.Span
}

func newSpanTable(cfg Config) *spanTable {
	if cfg.Tracing == nil {
		return nil
	}
	return &spanTable{spans: make(map[*Record]*tracing.Span)}
}

func (t *spanTable) put(r *Record, s *tracing.Span) {
	t.mu.Lock()
	t.spans[r] = s
	t.mu.Unlock()
}

// end ends the span of the outcome's record, if it has one.
func (t *spanTable) end(o *sink.Outcome) {
	if t == nil || o.Record == nil {
		return
	}
	t.mu.Lock()
	r := o.Record.(*Record)
	s, ok := t.spans[r]
	if ok {
		delete(t.spans, r)
	}
	t.mu.Unlock()
	if !ok {
		return
	}
	var err error
	if o.Err != nil {
		err = o.Err
	}
	s.End(o.Partition, o.Offset, err, o.At)
}

// errAbandoned ends the spans of records whose outcome never came: the
// sink closed first, and the events are re-delivered by a later session.
var errAbandoned = errors.New("sink closed before kafka answered; the event is sent again")

// abandon ends every span left, once the sink reports no more outcomes.
func (t *spanTable) abandon() {
	if t == nil {
		return
	}
	t.mu.Lock()
	left := t.spans
	t.spans = map[*Record]*tracing.Span{}
	t.mu.Unlock()
	now := time.Now()
	for _, s := range left {
		s.End(-1, -1, errAbandoned, now)
	}
}
