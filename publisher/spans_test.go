package publisher

import (
	"errors"
	"testing"
	"time"

	"github.com/rs/zerolog"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/tracing"
)

// resolverFor is a topicResolver that knows topic "t" already, so build
// needs no broker.
func resolverFor(t *testing.T, cfg Config) *topicResolver {
	t.Helper()
	cfg.TopicTemplate = "t"
	tmpl, err := parseTopicTemplate(cfg.TopicTemplate)
	if err != nil {
		t.Fatal(err)
	}
	r := newTopicResolver(cfg, zerolog.Nop(), tmpl, nil, nil)
	r.known["t"] = &topicInfo{name: "t", maxBytes: 1 << 20}
	return r
}

// Tracing off costs the build path nothing: two allocations per event,
// as without it. With tracing on, an event without a trace context that
// the sampler leaves out costs what the SDK's tracer spends on a root it
// does not record (measured: 7 allocations, the span name's among them)
// and no header.
func TestBuildAllocationsWithTracing(t *testing.T) {
	cfg := DefaultConfig()
	off := resolverFor(t, cfg)
	cfg.Tracing = tracing.NewRecords(sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample())), "wal", "at-least-once")
	on := resolverFor(t, cfg)
	traced := sampleEvent()
	traced.Headers = []byte(`{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`)
	traced.Layout = layout.Relay
	plain := sampleEvent()
	plain.Headers = []byte(`{"tenant": "acme"}`)
	plain.Layout = layout.Relay
	for name, tc := range map[string]struct {
		r    *topicResolver
		ev   *event.Event
		most float64
	}{"tracing off, traced event": {off, traced, 2}, "tracing on, untraced event left out by the sampler": {on, plain, 9}} {
		allocs := testing.AllocsPerRun(1000, func() {
			if _, err := tc.r.build(tc.ev); err != nil {
				t.Fatal(err)
			}
		})
		if allocs > tc.most {
			t.Errorf("%s: build allocates %.1f times per event, want at most %.0f", name, allocs, tc.most)
		}
	}
}

// A traced record's span ends at its outcome with where Kafka put it, or
// with the error; one whose outcome never came ends when the sink closes.
func TestSpanTableEndsEverySpanOnce(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	cfg := DefaultConfig()
	cfg.Tracing = tracing.NewRecords(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)), "wal", "at-least-once")
	r := resolverFor(t, cfg)
	ev := sampleEvent()
	ev.Headers = []byte(`{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`)
	ev.Layout = layout.Relay
	var recs []*Record
	for range 3 {
		rec, err := r.build(ev)
		if err != nil {
			t.Fatal(err)
		}
		recs = append(recs, rec)
	}
	now := time.Now()
	r.spans.end(&sink.Outcome{Delivery: sink.Delivery{Record: recs[0], Partition: 2, Offset: 9, At: now}})
	r.spans.end(&sink.Outcome{Delivery: sink.Delivery{Record: recs[1], Partition: -1, Offset: -1, At: now}, Err: recordError(sink.ClassPermanent, "", "", -1, errors.New("refused"), nil)})
	r.spans.end(&sink.Outcome{Delivery: sink.Delivery{Record: recs[0], At: now}}) // a second outcome ends nothing
	r.spans.abandon()
	ended := spans.Ended()
	if len(ended) != 3 {
		t.Fatalf("%d spans ended, want 3", len(ended))
	}
	if ended[0].Status().Code != 0 || ended[1].Status().Description == "" || ended[2].Status().Description != errAbandoned.Error() {
		t.Errorf("statuses %v, %v, %v: want ok, the refusal, abandoned", ended[0].Status(), ended[1].Status(), ended[2].Status())
	}
}
