package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/inbox"
)

const relaySpan = "00f067aa0ba902b7"

func traced(id, agg string, version int64) inbox.Event {
	e := ev(id, agg, version)
	e.Headers["traceparent"] = "00-4bf92f3577b34da6a3ce929d0e0e4736-" + relaySpan + "-01"
	return e
}

func spanAttrs(s sdktrace.ReadOnlySpan) map[string]string {
	m := map[string]string{}
	for _, kv := range s.Attributes() {
		m[string(kv.Key)] = kv.Value.String()
	}
	return m
}

// Each traced event runs its handler under a consumer span, the relay
// span's child, that says what the inbox did; an event without a trace
// context gets none.
func TestInboxConsumerSpanPerTracedEvent(t *testing.T) {
	_, conn := setup(t)
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	ib := newInbox(t, inbox.Config{CheckVersions: true, TracerProvider: tp})

	var handlerSpans []trace.SpanContext
	h := func(ctx context.Context, tx pgx.Tx, e inbox.Event) error {
		handlerSpans = append(handlerSpans, trace.SpanContextFromContext(ctx))
		return recordEffect(ctx, tx, e)
	}
	batch := []inbox.Event{traced("e1", "a", 1), traced("e3", "a", 3), ev("plain", "b", 0), traced("e1", "a", 1)}
	results, err := ib.HandleBatch(context.Background(), conn, batch, h)
	if err != nil || len(results) != 4 {
		t.Fatalf("results %v, error %v", results, err)
	}
	// Stale: a second event claiming version 1.
	if _, err := ib.Handle(context.Background(), conn, traced("e1b", "a", 1), h); err != nil {
		t.Fatal(err)
	}

	ended := spans.Ended()
	want := []struct{ id, outcome, version string }{
		{"e1", "applied", "1"}, {"e3", "parked", "3"}, {"e1", "duplicate", "1"}, {"e1b", "stale", "1"},
	}
	if len(ended) != len(want) {
		t.Fatalf("%d spans, want %d (none for the untraced event)", len(ended), len(want))
	}
	for i, w := range want {
		s := ended[i]
		a := spanAttrs(s)
		if a["outbox.event_id"] != w.id || a["inbox.outcome"] != w.outcome || a["outbox.aggregate_version"] != w.version {
			t.Errorf("span %d: event %s outcome %s version %s, want %+v", i, a["outbox.event_id"], a["inbox.outcome"], a["outbox.aggregate_version"], w)
		}
		if s.Parent().SpanID().String() != relaySpan || s.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("span %d: parent %s kind %v, want the relay's span %s, consumer", i, s.Parent().SpanID(), s.SpanKind(), relaySpan)
		}
	}
	// The handler ran twice (e1, plain): under e1's span, then with none.
	if len(handlerSpans) != 2 || handlerSpans[0].SpanID() != ended[0].SpanContext().SpanID() || handlerSpans[1].IsValid() {
		t.Errorf("handler span contexts %v, want e1's consumer span, then none", handlerSpans)
	}
}

// A handler error marks the failing event's span, and the events after
// it in the batch as not handled.
func TestInboxConsumerSpanRecordsAFailure(t *testing.T) {
	_, conn := setup(t)
	spans := tracetest.NewSpanRecorder()
	ib := newInbox(t, inbox.Config{TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))})
	boom := errors.New("boom")
	h := func(ctx context.Context, tx pgx.Tx, e inbox.Event) error {
		if e.ID == "bad" {
			return boom
		}
		return recordEffect(ctx, tx, e)
	}
	results, err := ib.HandleBatch(context.Background(), conn, []inbox.Event{traced("ok", "a", 0), traced("bad", "b", 0), traced("later", "c", 0)}, h)
	if !errors.Is(err, boom) || len(results) != 1 {
		t.Fatalf("results %v error %v; want one applied, then boom", results, err)
	}
	got := map[string]string{}
	for _, s := range spans.Ended() {
		a := spanAttrs(s)
		got[a["outbox.event_id"]] = a["inbox.outcome"]
	}
	if got["ok"] != "applied" || got["bad"] != "failed" || got["later"] != "not_handled" || len(got) != 3 {
		t.Errorf("outcomes %v", got)
	}
}

// The occurred-to-applied histogram observes each applied event with an
// occurred_at header (or a binary CloudEvent's ce_time), by the inbox's
// clock.
func TestInboxOccurredToAppliedHistogram(t *testing.T) {
	_, conn := setup(t)
	occurred := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	m := inbox.NewMetrics("billing")
	ib := newInbox(t, inbox.Config{Metrics: m, Now: func() time.Time { return occurred.Add(1500 * time.Millisecond) }})
	e := ev("e1", "a", 0)
	e.Headers["occurred_at"] = occurred.Format(time.RFC3339Nano)
	mustHandle(t, ib, conn, e)
	mustHandle(t, ib, conn, e)                // a duplicate: not observed
	mustHandle(t, ib, conn, ev("e2", "a", 0)) // no occurred_at: not observed
	ce := ev("e3", "a", 0)
	ce.Headers["ce_time"] = occurred.Add(500 * time.Millisecond).Format(time.RFC3339Nano) // a binary CloudEvent's time
	mustHandle(t, ib, conn, ce)

	ch := make(chan prometheus.Metric, 32)
	go func() { m.Collect(ch); close(ch) }()
	found := false
	for pm := range ch {
		var d dto.Metric
		if err := pm.Write(&d); err != nil {
			t.Fatal(err)
		}
		if h := d.GetHistogram(); h != nil {
			found = true
			if h.GetSampleCount() != 2 || h.GetSampleSum() != 2.5 {
				t.Errorf("histogram: %d samples summing %g, want 2, of 1.5 s and 1 s", h.GetSampleCount(), h.GetSampleSum())
			}
		}
	}
	if !found {
		t.Error("no histogram collected")
	}
}
