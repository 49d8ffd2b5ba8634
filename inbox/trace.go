package inbox

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Span attributes of the consumer span; the outbox.* ones match the
// relay's span.
const (
	attrOutcome  = "inbox.outcome"
	attrConsumer = "inbox.consumer"
	attrVersion  = "outbox.aggregate_version"
)

// tracerName names the inbox's tracer, as OpenTelemetry asks of a library.
const tracerName = "github.com/outbox-relay/outbox-relay/inbox"

// eventSpan is the consumer span of one event of a batch, and the context
// its handler runs in; ctx is the caller's for an event without a trace
// context.
type eventSpan struct {
	ctx  context.Context
	span trace.Span // nil: the event carries no trace context
}

// startSpans starts a consumer span for each event whose headers carry a
// valid W3C traceparent, as the child of the span it names (the relay's).
// It returns nil when no event is traced, so untraced batches cost one
// header lookup per event.
func (ib *Inbox) startSpans(ctx context.Context, events []Event) []eventSpan {
	var spans []eventSpan
	for i := range events {
		if events[i].Headers["traceparent"] == "" {
			continue
		}
		parent := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(events[i].Headers)))
		if !parent.IsValid() {
			continue
		}
		if spans == nil {
			spans = make([]eventSpan, len(events))
			for j := range spans {
				spans[j].ctx = ctx
			}
		}
		ev := &events[i]
		attrs := []attribute.KeyValue{
			attribute.String("messaging.system", "kafka"),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.message.id", ev.ID),
			attribute.String(attrConsumer, ib.cfg.Consumer),
			attribute.String("outbox.event_id", ev.ID),
			attribute.String("outbox.event_type", ev.EventType),
			attribute.String("outbox.aggregate_type", ev.AggregateType),
			attribute.String("outbox.aggregate_id", ev.AggregateID),
		}
		if ev.Version > 0 {
			attrs = append(attrs, attribute.Int64(attrVersion, ev.Version))
		}
		// The caller's own span, if any, is where the batch was fetched:
		// a link, since the event's parent is the relay's span.
		var links []trace.Link
		if local := trace.SpanContextFromContext(ctx); local.IsValid() {
			links = append(links, trace.Link{SpanContext: local})
		}
		spans[i].ctx, spans[i].span = ib.tracer.Start(trace.ContextWithRemoteSpanContext(ctx, parent), "process "+ev.EventType,
			trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...), trace.WithLinks(links...))
	}
	return spans
}

// endSpans ends the spans of a HandleBatch call: the events with a result
// with its outcome, the event that failed with its error, and those after
// it as not handled (they come again).
func endSpans(spans []eventSpan, results []Result, err error) {
	for i, s := range spans {
		if s.span == nil {
			continue
		}
		switch {
		case i < len(results):
			s.span.SetAttributes(attribute.String(attrOutcome, results[i].Outcome.String()))
			if results[i].Released > 0 {
				s.span.SetAttributes(attribute.Int("inbox.released", results[i].Released))
			}
		case i == len(results) && err != nil:
			s.span.SetAttributes(attribute.String(attrOutcome, "failed"))
			s.span.RecordError(err)
			s.span.SetStatus(codes.Error, err.Error())
		default:
			s.span.SetAttributes(attribute.String(attrOutcome, "not_handled"))
		}
		s.span.End()
	}
}

// ctxOf is the context event i's handler runs in.
func ctxOf(ctx context.Context, spans []eventSpan, i int) context.Context {
	if spans == nil {
		return ctx
	}
	return spans[i].ctx
}

// occurredAt is the event's occurred_at header (RFC 3339), or a
// CloudEvent's ce_time (ParseRecord fills it from a structured event's
// time); zero when the record has neither (Debezium's shape) or it does
// not parse.
func occurredAt(ev *Event) time.Time {
	v := ev.Headers["occurred_at"]
	if v == "" {
		v = ev.Headers["ce_time"]
	}
	if v == "" {
		return time.Time{}
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return time.Time{}
	}
	return t
}
