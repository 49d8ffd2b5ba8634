package tracing

import (
	"context"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/event"
)

const parentTP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func record(headers ...string) *event.Record {
	r := &event.Record{EventID: []byte("e1"), Key: []byte("42"), AggregateType: []byte("order")}
	for i := 0; i+1 < len(headers); i += 2 {
		r.Headers = append(r.Headers, event.Header{Key: []byte(headers[i]), Value: []byte(headers[i+1])})
	}
	return r
}

func recorder(sampler sdktrace.Sampler) (*tracetest.SpanRecorder, *sdktrace.TracerProvider) {
	rec := tracetest.NewSpanRecorder()
	return rec, sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(sampler))
}

// A record with a traceparent gets a producer span, the writer's child,
// from the commit to the ack, and carries the span's own context on.
func TestRecordSpanIsTheWritersChildAndTheConsumersParent(t *testing.T) {
	spans, tp := recorder(sdktrace.ParentBased(sdktrace.AlwaysSample()))
	rs := NewRecords(tp, "wal", "at-least-once")
	r := record("tenant", "acme", TraceparentHeader, parentTP, TracestateHeader, "v=1")
	commit := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	s, resized := rs.Start(r, &event.Event{Redelivery: true, Position: 0x16B3748}, "orders", commit)
	if s == nil || resized {
		t.Fatalf("span %v, resized %v: want a span and headers of the same size", s, resized)
	}
	ack := commit.Add(30 * time.Millisecond)
	s.End(3, 1234, nil, ack)

	ended := spans.Ended()
	if len(ended) != 1 {
		t.Fatalf("%d spans ended, want 1", len(ended))
	}
	got := ended[0]
	if got.Parent().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || got.Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Errorf("parent %v, want the writer's span", got.Parent())
	}
	if !got.StartTime().Equal(commit) || !got.EndTime().Equal(ack) || got.SpanKind() != trace.SpanKindProducer {
		t.Errorf("span from %v to %v, kind %v: want commit to ack, producer", got.StartTime(), got.EndTime(), got.SpanKind())
	}
	attrs := map[string]string{}
	for _, kv := range got.Attributes() {
		attrs[string(kv.Key)] = kv.Value.String()
	}
	for k, v := range map[string]string{
		"messaging.destination.name": "orders", "messaging.destination.partition.id": "3", "messaging.kafka.offset": "1234",
		AttrEventID: "e1", AttrAggregateType: "order", AttrAggregateID: "42", AttrSource: "wal", AttrDelivery: "at-least-once", AttrRedelivery: "true",
		AttrLSN: "0/16B3748",
	} {
		if attrs[k] != v {
			t.Errorf("attribute %s = %q, want %q", k, attrs[k], v)
		}
	}
	want := "00-4bf92f3577b34da6a3ce929d0e0e4736-" + got.SpanContext().SpanID().String() + "-01"
	if tp := string(r.Header(TraceparentHeader)); tp != want {
		t.Errorf("record's traceparent %s, want the relay span's %s", tp, want)
	}
	if ts := string(r.Header(TracestateHeader)); ts != "v=1" {
		t.Errorf("tracestate %q, want the writer's v=1 carried on", ts)
	}
	if string(r.Header("tenant")) != "acme" || len(r.Headers) != 3 {
		t.Errorf("other headers changed: %v", r.Headers)
	}
}

// No traceparent (or a malformed one): the sampler decides, as for any
// root span. Sampled, the record gets a root span and carries its
// context on (a malformed traceparent is replaced); left out, it gets no
// span and stays as it was.
func TestRecordWithoutTraceContextFollowsTheSampler(t *testing.T) {
	for name, sampler := range map[string]sdktrace.Sampler{"sampled": sdktrace.ParentBased(sdktrace.AlwaysSample()), "left out": sdktrace.NeverSample()} {
		t.Run(name, func(t *testing.T) {
			spans, tp := recorder(sampler)
			rs := NewRecords(tp, "poll", "at-least-once")
			for _, r := range []*event.Record{record("tenant", "acme"), record(TraceparentHeader, "00-zz-yy-01")} {
				before := string(r.Header(TraceparentHeader))
				s, resized := rs.Start(r, &event.Event{Position: 77}, "orders", time.Now())
				after := string(r.Header(TraceparentHeader))
				if name == "left out" {
					if s != nil || resized || after != before {
						t.Errorf("span %v, traceparent %q then %q: want no span and the record untouched", s, before, after)
					}
					continue
				}
				if s == nil {
					t.Fatal("no span for a sampled root")
				}
				if !resized {
					t.Errorf("traceparent %q became %q, but the record's size was not to be counted again", before, after)
				}
				s.End(1, 2, nil, time.Now())
				got := spans.Ended()[len(spans.Ended())-1]
				if got.Parent().IsValid() {
					t.Errorf("parent %v, want a root span", got.Parent())
				}
				if want := "00-" + got.SpanContext().TraceID().String() + "-" + got.SpanContext().SpanID().String() + "-01"; after != want {
					t.Errorf("record's traceparent %q, want the root span's %q", after, want)
				}
				var seq int64
				for _, kv := range got.Attributes() {
					if kv.Key == AttrPollSeq {
						seq = kv.Value.AsInt64()
					}
				}
				if seq != 77 {
					t.Errorf("attribute %s = %d, want the row's seq 77", AttrPollSeq, seq)
				}
			}
			if name == "left out" && len(spans.Started()) != 0 {
				t.Errorf("%d spans recorded, want 0", len(spans.Started()))
			}
		})
	}
}

// An unsampled writer's span: the parent-based sampler records nothing,
// but the record still carries a context (not sampled) for the consumer.
func TestUnsampledParentRecordsNothingButCarriesContext(t *testing.T) {
	spans, tp := recorder(sdktrace.ParentBased(sdktrace.AlwaysSample()))
	rs := NewRecords(tp, "wal", "exactly-once")
	r := record(TraceparentHeader, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
	if s, _ := rs.Start(r, &event.Event{}, "orders", time.Now()); s != nil {
		t.Error("span to end for an unsampled parent")
	}
	tp0 := string(r.Header(TraceparentHeader))
	if !strings.HasPrefix(tp0, "00-4bf92f3577b34da6a3ce929d0e0e4736-") || !strings.HasSuffix(tp0, "-00") || strings.Contains(tp0, "00f067aa0ba902b7") {
		t.Errorf("traceparent %s: want the same trace, a new span id, not sampled", tp0)
	}
	if n := len(spans.Ended()); n != 0 {
		t.Errorf("%d spans recorded, want 0", n)
	}
}

// Debezium's tracingspancontext column holds java.util.Properties text;
// its traceparent is the parent, and the record gains W3C headers, as
// Debezium's router injects them.
func TestDebeziumSpanContextColumn(t *testing.T) {
	spans, tp := recorder(sdktrace.AlwaysSample())
	rs := NewRecords(tp, "wal", "at-least-once")
	r := record("id", "e1", DebeziumSpanContextField, "#Tue Dec 02 10:00:00 UTC 2026\ntraceparent="+parentTP+"\ntracestate=v\\=1\n")
	s, resized := rs.Start(r, &event.Event{}, "orders", time.Now())
	if s == nil || !resized {
		t.Fatalf("span %v resized %v: want a span and a new header", s, resized)
	}
	s.End(0, 1, nil, time.Now())
	got := spans.Ended()[0]
	if got.Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Errorf("parent %v, want the column's span", got.Parent())
	}
	if tp := string(r.Header(TraceparentHeader)); !strings.Contains(tp, got.SpanContext().SpanID().String()) {
		t.Errorf("traceparent header %q, want the relay span's context", tp)
	}
	if ts := string(r.Header(TracestateHeader)); ts != "v=1" {
		t.Errorf("tracestate header %q, want v=1 unescaped", ts)
	}
	// Issue 40.11: the propagator sets tracestate first, and both were
	// appended in that order.
	var keys []string
	for _, h := range r.Headers {
		keys = append(keys, string(h.Key))
	}
	if got, want := strings.Join(keys, ","), "id,"+DebeziumSpanContextField+","+TraceparentHeader+","+TracestateHeader; got != want {
		t.Errorf("headers in order %s, want %s", got, want)
	}
}

func TestConfigValidateNamesTheFlag(t *testing.T) {
	for _, tc := range []struct {
		c    Config
		flag string
	}{
		{Config{Exporter: "jaeger"}, Flags.Exporter},
		{Config{Exporter: "otlp", Protocol: "http/json"}, Flags.Protocol},
		{Config{Exporter: "otlp", Endpoint: "127.0.0.1:4318"}, Flags.Endpoint},
		{Config{Exporter: "otlp", Sampler: "sometimes"}, Flags.Sampler},
		{Config{Exporter: "otlp", Sampler: "traceidratio", SamplerArg: "2"}, Flags.SamplerArg},
	} {
		err := tc.c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("%+v: error %v, want one naming %s", tc.c, err, tc.flag)
		}
	}
	env := map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "always_on", "OTEL_SERVICE_NAME": "env"}
	c := Config{ServiceName: "flag"}.WithEnv(func(k string) string { return env[k] })
	if c.Exporter != "otlp" || c.Protocol != "grpc" || c.Sampler != "always_on" || c.ServiceName != "flag" {
		t.Errorf("with env: %+v; want the environment below what the flags set", c)
	}
	if err := c.Validate(); err != nil {
		t.Error(err)
	}
	tp, err := Provider(context.Background(), Config{Exporter: "none"}, "test")
	if tp != nil || err != nil {
		t.Errorf("exporter none: provider %v, error %v; want neither", tp, err)
	}
}
