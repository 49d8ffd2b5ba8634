package tracing

import (
	"bufio"
	"context"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
)

// The W3C headers, and the column Debezium's outbox router reads a
// serialized span context from (its tracing.span.context.field default).
const (
	TraceparentHeader        = "traceparent"
	TracestateHeader         = "tracestate"
	DebeziumSpanContextField = "tracingspancontext"
)

// Span attributes beyond OpenTelemetry's messaging conventions.
const (
	AttrEventID       = "outbox.event_id"
	AttrAggregateType = "outbox.aggregate_type"
	AttrAggregateID   = "outbox.aggregate_id"
	AttrSource        = "outbox.source"
	AttrDelivery      = "outbox.delivery"
	AttrRedelivery    = "outbox.redelivery"
	// AttrLSN is the WAL position the wal and messages sources found the
	// event at; AttrPollSeq the outbox row's seq in poll mode.
	AttrLSN     = "outbox.lsn"
	AttrPollSeq = "outbox.poll_seq"
)

// Records starts and ends the relay's span of each traced record. One
// Records serves every sink of a process; each sink keeps its own spans
// in flight (a Span, from Start to End).
type Records struct {
	tracer trace.Tracer
	fixed  []attribute.KeyValue
	poll   bool // positions are seqs, not LSNs
}

// NewRecords makes the spans of a relay reading source (wal, messages or
// poll) and delivering in mode (at-least-once or exactly-once) with tp's
// tracer.
func NewRecords(tp trace.TracerProvider, source, mode string) *Records {
	return &Records{
		tracer: tp.Tracer("github.com/outbox-relay/outbox-relay"),
		fixed: []attribute.KeyValue{
			attribute.String("messaging.system", "kafka"),
			attribute.String("messaging.operation.type", "send"),
			attribute.String(AttrSource, source),
			attribute.String(AttrDelivery, mode),
		},
		poll: source == "poll",
	}
}

// Span is one record's span, to end with End once Kafka answered.
type Span struct{ span trace.Span }

// Start begins rec's span, starting at commit (the source transaction's
// commit time; now when zero), and writes the span's context into rec's
// traceparent and tracestate headers. A record with a valid traceparent
// header (or, in Debezium's shape, a tracingspancontext one holding one)
// gets a child of that span. One without starts a trace of its own if the
// sampler picks it, as any root span does: with the SDK's default
// sampler every event is traced, with parentbased_traceidratio a share
// of them. resized says the headers' encoded size changed (a header
// added, or one replaced by a value of another length, such as a malformed
// traceparent), so the record's size must be counted again. A record whose span is not sampled gets nil.
func (t *Records) Start(rec *event.Record, ev *event.Event, topic string, commit time.Time) (s *Span, resized bool) {
	ctx := context.Background()
	parent := parentOf(rec)
	if parent.IsValid() {
		ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
	}
	if commit.IsZero() {
		commit = time.Now()
	}
	ctx, span := t.tracer.Start(ctx, "send "+topic, trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(commit))
	carrier := headerCarrier{rec: rec}
	if !span.IsRecording() {
		if !parent.IsValid() {
			return nil, false // a root the sampler left out: the record stays untraced
		}
		// A parent not sampled: nothing to end, but the consumer still
		// continues the trace from the context written here.
		propagation.TraceContext{}.Inject(ctx, &carrier)
		return nil, carrier.resized
	}
	attrs := make([]attribute.KeyValue, 0, len(t.fixed)+7)
	attrs = append(attrs, t.fixed...)
	attrs = append(attrs,
		attribute.String("messaging.destination.name", topic),
		attribute.String("messaging.message.id", string(rec.EventID)),
		attribute.String(AttrEventID, string(rec.EventID)),
		attribute.String(AttrAggregateType, string(rec.AggregateType)),
		attribute.String(AttrAggregateID, string(rec.Key)))
	if t.poll {
		attrs = append(attrs, attribute.Int64(AttrPollSeq, int64(ev.Position)))
	} else if ev.Position != 0 {
		attrs = append(attrs, attribute.String(AttrLSN, lsn.LSN(ev.Position).String()))
	}
	if ev.Redelivery {
		attrs = append(attrs, attribute.Bool(AttrRedelivery, true))
	}
	span.SetAttributes(attrs...)
	propagation.TraceContext{}.Inject(ctx, &carrier)
	return &Span{span: span}, carrier.resized
}

// End ends the span at the acknowledgement (or failure) at, with where
// Kafka put the record. A nil Span does nothing.
func (s *Span) End(partition int32, offset int64, err error, at time.Time) {
	if s == nil {
		return
	}
	if partition >= 0 {
		s.span.SetAttributes(attribute.String("messaging.destination.partition.id", itoa(int64(partition))))
	}
	if offset >= 0 {
		s.span.SetAttributes(attribute.Int64("messaging.kafka.offset", offset))
	}
	if err != nil {
		s.span.SetStatus(codes.Error, err.Error())
	}
	s.span.End(trace.WithTimestamp(at))
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// parentOf is the span context rec's headers carry.
func parentOf(rec *event.Record) trace.SpanContext {
	// A record without a context returns before the carrier exists: it
	// escapes to the heap, and with tracing on every record comes here.
	var props map[string]string
	if rec.Header(TraceparentHeader) == nil {
		// Debezium's column holds java.util.Properties text, e.g.
		// "traceparent=00-...\ntracestate=...".
		raw := rec.Header(DebeziumSpanContextField)
		if raw == nil {
			return trace.SpanContext{}
		}
		props = properties(string(raw))
	}
	return extract(rec, props)
}

func extract(rec *event.Record, props map[string]string) trace.SpanContext {
	carrier := &headerCarrier{rec: rec, props: props}
	return trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), carrier))
}

// properties reads the keys and values of java.util.Properties text: one
// key=value (or key:value) a line, # and ! comments, and a backslash
// escaping the next character (Properties.store writes tracestate's "="
// as "\="). W3C values are ASCII, so no \u escapes are needed.
func properties(text string) map[string]string {
	props := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == '!' {
			continue
		}
		i := strings.IndexAny(line, "=:")
		if i < 0 {
			continue
		}
		props[unescape(strings.TrimSpace(line[:i]))] = unescape(strings.TrimSpace(line[i+1:]))
	}
	return props
}

func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+1 < len(s) {
			i++
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// headerCarrier is a record's headers as a propagation.TextMapCarrier:
// it reads from props when set (a Debezium span context), and writes
// into the record, replacing a header or adding it.
type headerCarrier struct {
	rec     *event.Record
	props   map[string]string
	resized bool
}

func (c *headerCarrier) Get(key string) string {
	if c.props != nil {
		return c.props[key]
	}
	return string(c.rec.Header(key))
}

func (c *headerCarrier) Set(key, value string) {
	for i := range c.rec.Headers {
		if string(c.rec.Headers[i].Key) == key {
			c.resized = c.resized || len(c.rec.Headers[i].Value) != len(value)
			c.rec.Headers[i].Value = []byte(value)
			return
		}
	}
	h := event.Header{Key: []byte(key), Value: []byte(value)}
	c.resized = true
	if key == TraceparentHeader {
		// The propagator sets tracestate first; traceparent goes before
		// it, the order readers and the W3C examples expect.
		for i := range c.rec.Headers {
			if string(c.rec.Headers[i].Key) == TracestateHeader {
				c.rec.Headers = slices.Insert(c.rec.Headers, i, h)
				return
			}
		}
	}
	c.rec.Headers = append(c.rec.Headers, h)
}

func (c *headerCarrier) Keys() []string { return []string{TraceparentHeader, TracestateHeader} }
