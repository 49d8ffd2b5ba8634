package tracing_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// The services' names in Jaeger.
const (
	serviceName  = "drill-service"
	relayName    = "drill-relay"
	consumerName = "drill-consumer"
)

// provider is an application's tracer provider exporting OTLP/HTTP to
// Jaeger, shut down (flushed) when the test ends.
func provider(t *testing.T, j *harness.Jaeger, service string) *sdktrace.TracerProvider {
	t.Helper()
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(j.OTLPHTTPEndpoint()+"/v1/traces"))
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(50*time.Millisecond)),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", service))))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp
}

// flush sends what tp holds to Jaeger now.
func flush(t *testing.T, tp *sdktrace.TracerProvider) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := tp.ForceFlush(ctx); err != nil {
		t.Fatalf("flush spans to Jaeger: %v", err)
	}
}

// service writes events as a traced service does: each in a transaction
// of its own, under a span of its own, with package outbox (Writer, or
// Emitter for the messages source), and notes each event's trace.
type service struct {
	e      *harness.Env
	tp     *sdktrace.TracerProvider
	conn   *pgx.Conn
	write  func(ctx context.Context, tx pgx.Tx, ev outbox.Event) ([]string, error)
	mu     sync.Mutex
	traced map[string]trace.SpanContext // event id -> the service span
	plain  map[string]bool              // event ids written without a span
}

func newService(t *testing.T, e *harness.Env, j *harness.Jaeger) *service {
	t.Helper()
	s := &service{e: e, tp: provider(t, j, serviceName), conn: e.DB.Connect(t), traced: map[string]trace.SpanContext{}, plain: map[string]bool{}}
	if e.Source == "messages" {
		em, err := outbox.NewEmitter("")
		if err != nil {
			t.Fatal(err)
		}
		s.write = func(ctx context.Context, tx pgx.Tx, ev outbox.Event) ([]string, error) { return em.Emit(ctx, tx, ev) }
	} else {
		w, err := outbox.New("")
		if err != nil {
			t.Fatal(err)
		}
		s.write = func(ctx context.Context, tx pgx.Tx, ev outbox.Event) ([]string, error) { return w.Write(ctx, tx, ev) }
	}
	return s
}

// placeOrder commits event n, under a span when traced. It may run on
// another goroutine than the test's, so it returns its error.
func (s *service) placeOrder(n int, traced bool) error {
	ctx := context.Background()
	var span trace.Span
	if traced {
		ctx, span = s.tp.Tracer("drill").Start(ctx, "place order", trace.WithSpanKind(trace.SpanKindServer))
		defer span.End()
	}
	ev := outbox.Event{AggregateType: "order", AggregateID: fmt.Sprintf("o-%d", n%7), EventType: "OrderPlaced",
		Payload: fmt.Appendf(nil, `{"n": %d}`, n)}
	tx, err := s.conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	ids, err := s.write(ctx, tx, ev)
	if err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	s.e.Record(ids, []harness.OutboxEvent{{AggregateType: ev.AggregateType, AggregateID: ev.AggregateID}})
	s.mu.Lock()
	defer s.mu.Unlock()
	if traced {
		s.traced[ids[0]] = span.SpanContext()
	} else {
		s.plain[ids[0]] = true
	}
	return nil
}

// relayArgs turn tracing on with the flags, exporting to j.
func relayArgs(j *harness.Jaeger, extra ...string) []string {
	return append([]string{"--otel-traces-exporter", "otlp", "--otel-exporter-otlp-endpoint", j.OTLPHTTPEndpoint(),
		"--otel-service-name", relayName}, extra...)
}

// relayEnv has the relay export its spans every 50 ms instead of the
// SDK's 5 s, so that a SIGKILL loses only the last few.
var relayEnv = []string{harness.LogLevelInfo, "OTEL_BSP_SCHEDULE_DELAY=50"}

// stopRelay ends a relay with SIGTERM, which flushes its spans, and waits
// for it to exit.
func stopRelay(t *testing.T, p *harness.Process) {
	t.Helper()
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, time.Minute, "the relay exits on SIGTERM", p.Exited)
}

// applyAll hands every record to an inbox, in offset order per partition,
// with a tracer provider of its own, and returns each record's outcome by
// its position.
func applyAll(t *testing.T, e *harness.Env, j *harness.Jaeger, records []harness.Record) map[string]inbox.Outcome {
	t.Helper()
	ctx := context.Background()
	conn := e.DB.Connect(t)
	ddl, err := inbox.SQL(inbox.Tables{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, ddl); err != nil {
		t.Fatal(err)
	}
	tp := provider(t, j, consumerName)
	ib, err := inbox.New(inbox.Config{Consumer: "billing", TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	sorted := slices.Clone(records)
	slices.SortFunc(sorted, func(a, b harness.Record) int {
		if c := strings.Compare(a.Topic, b.Topic); c != 0 {
			return c
		}
		if a.Partition != b.Partition {
			return int(a.Partition - b.Partition)
		}
		return int(a.Offset - b.Offset)
	})
	out := map[string]inbox.Outcome{}
	for _, r := range sorted {
		headers := make([]inbox.Header, len(r.HeaderKeys))
		for i, k := range r.HeaderKeys {
			headers[i] = inbox.Header{Key: []byte(k), Value: r.HeaderValues[i]}
		}
		ev, err := inbox.ParseRecord(r.Key, headers, r.Value)
		if err != nil {
			t.Fatal(err)
		}
		res, err := ib.Handle(ctx, conn, ev, func(context.Context, pgx.Tx, inbox.Event) error { return nil })
		if err != nil {
			t.Fatal(err)
		}
		out[pos(r)] = res.Outcome
	}
	flush(t, tp)
	return out
}

func pos(r harness.Record) string { return fmt.Sprintf("%s/%d@%d", r.Topic, r.Partition, r.Offset) }

// parentSpanID is the span id a traceparent header names, "" if none.
func parentSpanID(traceparent string) string {
	parts := strings.Split(traceparent, "-")
	if len(parts) != 4 {
		return ""
	}
	return parts[2]
}

// want says what the relay spans of a run must carry, and whether its
// sampler starts traces for events written without a span (roots).
type want struct {
	source, delivery string
	roots            bool
}

// checkRootRelaySpan: the record of an event written without a span names
// a relay span that is the root of its trace.
func checkRootRelaySpan(t *testing.T, j *harness.Jaeger, id string, r harness.Record) {
	t.Helper()
	parts := strings.Split(r.Headers["traceparent"], "-")
	if len(parts) != 4 {
		t.Errorf("event %s, written without a span: traceparent %q, want one naming the relay's root span", id, r.Headers["traceparent"])
		return
	}
	var spans []harness.JaegerSpan
	var qerr error
	var root harness.JaegerSpan
	if !harness.Poll(time.Minute, func() bool {
		spans, qerr = j.Trace(parts[1])
		for _, sp := range spans {
			if sp.SpanID == parts[2] {
				root = sp
				return true
			}
		}
		return false
	}) {
		t.Errorf("event %s, written without a span: trace %s has no span %s (%d spans, %v)", id, parts[1], parts[2], len(spans), qerr)
		return
	}
	if root.Service != relayName || root.Parent() != "" || root.Tag("outbox.event_id") != id {
		t.Errorf("event %s, written without a span: span %s is %s's with parent %q and event %q; want the relay's, a root, for this event",
			id, parts[2], root.Service, root.Parent(), root.Tag("outbox.event_id"))
	}
}

// checkTraces asserts, for every traced event, one trace in Jaeger with
// the service span at its root; for each of the event's records, a relay
// span whose id the record's traceparent carries, CHILD_OF the service
// span, with the record's topic, partition and offset; and a consumer
// span CHILD_OF that relay span saying what the inbox did with the record
// (applied for the first, duplicate for a re-delivery). An event written
// without a span follows the relay's sampler: with w.roots, each of its
// records names a relay span at the root of a trace of its own; without,
// it has no traceparent at all. It returns how many events have more than
// one record.
func checkTraces(t *testing.T, j *harness.Jaeger, s *service, records []harness.Record, outcomes map[string]inbox.Outcome, w want) (redelivered int) {
	t.Helper()
	byEvent := map[string][]harness.Record{}
	for _, r := range records {
		byEvent[r.EventID()] = append(byEvent[r.EventID()], r)
	}
	for id := range s.plain {
		for _, r := range byEvent[id] {
			traceparent, ok := r.Headers["traceparent"]
			if !w.roots {
				if ok {
					t.Errorf("event %s, written without a span, has traceparent %q; the sampler traces only sampled parents", id, traceparent)
				}
				continue
			}
			checkRootRelaySpan(t, j, id, r)
		}
	}
	for id, sc := range s.traced {
		recs := byEvent[id]
		if len(recs) == 0 {
			t.Errorf("event %s: no record", id)
			continue
		}
		slices.SortFunc(recs, func(a, b harness.Record) int { return int(a.Offset - b.Offset) })
		if len(recs) > 1 {
			redelivered++
		}
		var spans []harness.JaegerSpan
		var qerr error
		if !harness.Poll(time.Minute, func() bool {
			spans, qerr = j.Trace(sc.TraceID().String())
			return qerr == nil && len(spans) >= 1+2*len(recs)
		}) {
			t.Errorf("event %s: trace %s has %d spans (%v), want %d: the service's, and a relay and a consumer span per record", id, sc.TraceID(), len(spans), qerr, 1+2*len(recs))
			continue
		}
		checkEvent(t, id, sc, spans, recs, outcomes, w)
	}
	return redelivered
}

func checkEvent(t *testing.T, id string, sc trace.SpanContext, spans []harness.JaegerSpan, recs []harness.Record, outcomes map[string]inbox.Outcome, w want) {
	t.Helper()
	byID := map[string]harness.JaegerSpan{}
	var consumers []harness.JaegerSpan
	for _, sp := range spans {
		byID[sp.SpanID] = sp
		if sp.Service == consumerName {
			consumers = append(consumers, sp)
		}
	}
	root, ok := byID[sc.SpanID().String()]
	if !ok || root.Service != serviceName || root.Parent() != "" {
		t.Errorf("event %s: service span %s missing, or not the trace's root: %+v", id, sc.SpanID(), root)
		return
	}
	if len(spans) != 1+2*len(recs) {
		t.Errorf("event %s: %d spans for %d records, want %d", id, len(spans), len(recs), 1+2*len(recs))
	}
	for i, r := range recs {
		relayID := parentSpanID(r.Headers["traceparent"])
		relay, ok := byID[relayID]
		if !ok || relay.Service != relayName {
			t.Errorf("event %s, record %s: its traceparent %q names no relay span in the trace", id, pos(r), r.Headers["traceparent"])
			continue
		}
		if relay.Parent() != root.SpanID {
			t.Errorf("event %s, record %s: relay span %s is CHILD_OF %q, want the service span %s", id, pos(r), relayID, relay.Parent(), root.SpanID)
		}
		for k, v := range map[string]string{
			"messaging.destination.name": r.Topic, "messaging.destination.partition.id": strconv.Itoa(int(r.Partition)),
			"messaging.kafka.offset": strconv.FormatInt(r.Offset, 10), "outbox.event_id": id, "outbox.aggregate_id": string(r.Key),
			"outbox.aggregate_type": "order", "outbox.source": w.source, "outbox.delivery": w.delivery, "span.kind": "producer",
		} {
			if got := relay.Tag(k); got != v {
				t.Errorf("event %s, record %s: relay span tag %s = %q, want %q", id, pos(r), k, got, v)
			}
		}
		wantOutcome := "applied"
		if i > 0 {
			wantOutcome = "duplicate"
		}
		if got := outcomes[pos(r)].String(); got != wantOutcome {
			t.Errorf("event %s, record %s: the inbox said %s, want %s", id, pos(r), got, wantOutcome)
		}
		var found bool
		for _, c := range consumers {
			if c.Parent() != relayID {
				continue
			}
			found = true
			if got := c.Tag("inbox.outcome"); got != wantOutcome {
				t.Errorf("event %s, record %s: consumer span outcome %q, want %q", id, pos(r), got, wantOutcome)
			}
		}
		if !found {
			t.Errorf("event %s, record %s: no consumer span CHILD_OF relay span %s", id, pos(r), relayID)
		}
	}
}

// Every source and delivery mode carries the trace: the relay's span is
// the service span's child and the consumer's parent, with the record's
// place in Kafka. An event written without a span starts a trace at the
// relay with the default sampler, and none in the run whose sampler is
// parentbased_always_off. One run takes the settings from the
// OpenTelemetry environment and exports over gRPC, the others from flags
// over HTTP.
func TestTraceEverySourceAndDelivery(t *testing.T) {
	j := harness.StartJaeger(t)
	for _, tc := range []struct {
		source, delivery string
		env              bool
		sampler          string // empty: the default, parentbased_always_on
	}{
		{"wal", "at-least-once", false, ""},
		{"wal", "exactly-once", true, ""},
		{"messages", "at-least-once", false, "parentbased_always_off"},
		{"messages", "exactly-once", false, ""},
		{"poll", "at-least-once", false, ""},
	} {
		t.Run(tc.source+"/"+tc.delivery, func(t *testing.T) {
			e := harness.NewRelayEnv(t, cluster, 3)
			e.Source = tc.source
			e.Migrate()
			s := newService(t, e, j)
			for n := range 6 {
				if err := s.placeOrder(n, n != 3); err != nil {
					t.Fatal(err)
				}
			}
			flush(t, s.tp)
			args := []string{"--delivery", tc.delivery}
			if tc.sampler != "" {
				args = append(args, "--otel-traces-sampler", tc.sampler)
			}
			env := relayEnv
			if tc.env {
				env = append(slices.Clone(relayEnv), "OTEL_TRACES_EXPORTER=otlp", "OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
					"OTEL_EXPORTER_OTLP_ENDPOINT="+j.OTLPGRPCEndpoint(), "OTEL_SERVICE_NAME="+relayName, "OTEL_TRACES_SAMPLER=parentbased_always_on")
			} else {
				args = relayArgs(j, args...)
			}
			relay := harness.StartProcess(t, e.Bin, e.Args("run", args...), env)
			ids, _ := e.Committed()
			records := harness.ConsumeEventIDs(t, e.Brokers, harness.RelayTopics, ids, 2*time.Minute)
			stopRelay(t, relay)
			outcomes := applyAll(t, e, j, records)
			checkTraces(t, j, s, records, outcomes, want{tc.source, tc.delivery, tc.sampler == ""})
		})
	}
}

// TestDrillTraceThroughRelayCrash: a service writes events under spans,
// the relay publishes them and is SIGKILLed once mid-stream, after Kafka
// acknowledged part of the stream and before the relay confirmed it to
// PostgreSQL, so the next relay re-delivers that part; a consumer applies
// every record through the inbox. Jaeger must then hold, for every event,
// the service span, then one relay span per record (CHILD_OF the service
// span), then per record a consumer span (CHILD_OF that relay span) that
// says applied for the first and duplicate for a re-delivery.
//
// To be sure the killed relay confirmed nothing it had published, Kafka's
// answers are delayed (so records are always in flight while the service
// writes, and the relay never confirms on going idle), the relay reports
// its position only every hour (--status-interval; its keepalive schedule
// still reports every 10 s, see TestMain), and once part of
// the stream is in Kafka, produce requests are cut so nothing more is
// acknowledged while the test waits for the relay's spans to reach Jaeger.
//
// Reduced: 100 events before the kill, 100 after; OUTBOX_RELAY_DRILL_SIZE=full:
// 1,000 and 2,000.
func TestDrillTraceThroughRelayCrash(t *testing.T) {
	before := harness.Sized(100, 1000)
	after := harness.Sized(100, 2000)
	j := harness.StartJaeger(t)
	e := harness.NewRelayEnv(t, cluster, 3)
	e.Migrate()
	s := newService(t, e, j)
	startLSN := e.ConfirmedFlush()

	removeDelay := e.Kafka.DelayProduce(100 * time.Millisecond)
	relay := harness.StartProcess(t, e.Bin, e.Args("run", relayArgs(j, "--status-interval", "1h")...), relayEnv)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var writeErr error
	n := 0
	wg.Go(func() {
		for ; ; n++ {
			select {
			case <-stop:
				return
			default:
			}
			if writeErr = s.placeOrder(n, true); writeErr != nil {
				return
			}
		}
	})
	topic := "outbox.event.order"
	harness.WaitFor(t, 2*time.Minute, fmt.Sprintf("the relay publishes %d records", before), func() bool {
		_, got := harness.TopicRecords(t, e.Brokers, topic)
		return got >= int64(before) || relay.Exited()
	})
	cut := e.Kafka.CutProduce(-1)
	removeDelay()
	// Requests under way when the cut came are still answered: wait until
	// Kafka holds nothing new and Jaeger holds a span of every record.
	var published []harness.Record
	harness.WaitFor(t, time.Minute, "Jaeger holds the relay span of every record in Kafka", func() bool {
		recs := harness.ConsumeToEnd(t, e.Brokers, topic, 30*time.Second)
		if len(recs) != len(published) {
			published = recs
			return false
		}
		for _, r := range recs {
			spans, err := j.Trace(strings.Split(r.Headers["traceparent"], "-")[1])
			if err != nil || !slices.ContainsFunc(spans, func(sp harness.JaegerSpan) bool { return sp.SpanID == parentSpanID(r.Headers["traceparent"]) }) {
				return false
			}
		}
		return true
	})
	if relay.Exited() {
		t.Fatalf("the relay exited on its own:\n%s", relay.Output())
	}
	killedAt := e.ConfirmedFlush()
	relay.Kill()
	close(stop)
	wg.Wait()
	if writeErr != nil {
		t.Fatal(writeErr)
	}
	t.Logf("killed the relay with %d records in Kafka, %d events committed; slot confirmed %s (at start %s)", len(published), e.CommittedCount(), killedAt, startLSN)
	cut.Remove()

	relay = harness.StartProcess(t, e.Bin, e.Args("run", relayArgs(j)...), relayEnv)
	for i := range after {
		if err := s.placeOrder(n+1+i, true); err != nil {
			t.Fatal(err)
		}
	}
	flush(t, s.tp)
	ids, order := e.Committed()
	harness.ConsumeEventIDs(t, e.Brokers, harness.RelayTopics, ids, 2*time.Minute)
	stopRelay(t, relay)
	records := harness.ConsumeToEnd(t, e.Brokers, topic, time.Minute)
	harness.CheckNoLoss(t, records, ids)
	harness.CheckPerAggregateOrder(t, records, order)

	outcomes := applyAll(t, e, j, records)
	redelivered := checkTraces(t, j, s, records, outcomes, want{"wal", "at-least-once", true})
	t.Logf("%d events, %d records, %d events re-delivered after the kill", len(ids), len(records), redelivered)
	if redelivered == 0 {
		t.Error("no event was re-delivered after the kill; the drill proved nothing about re-delivery")
	}
}

// Debezium's outbox table carries the writer's span context serialized as
// java.util.Properties text in a tracingspancontext column. Placed as a
// header, it is copied as it is, and the relay makes its span the child
// of the traceparent in it and adds traceparent (and tracestate) headers
// naming its own span, as Debezium's router does; a row without it gets
// neither.
func TestTraceDebeziumSpanContextColumn(t *testing.T) {
	j := harness.StartJaeger(t)
	e := harness.NewRelayEnv(t, cluster, 3)
	e.DB.Exec(t, `CREATE TABLE public.outbox_events (
		id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL, aggregateid varchar(255) NOT NULL,
		type varchar(255) NOT NULL, payload jsonb, tracingspancontext varchar(256))`)
	layout := []string{"--outbox-layout", "debezium", "--header-columns", "tracingspancontext"}
	e.Migrate(layout...)
	tp := provider(t, j, serviceName)
	ctx, span := tp.Tracer("drill").Start(context.Background(), "place order")
	sc := span.SpanContext()
	props := fmt.Sprintf("#Wed Dec 02 10:00:00 UTC 2026\ntraceparent=00-%s-%s-01\ntracestate=vendor\\=1\n", sc.TraceID(), sc.SpanID())
	traced, plain := harness.NewUUID(), harness.NewUUID()
	conn := e.DB.Connect(t)
	for id, column := range map[string]any{traced: props, plain: nil} {
		if _, err := conn.Exec(ctx, `INSERT INTO outbox_events VALUES ($1, 'order', 'o-1', 'OrderPlaced', '{}', $2)`, id, column); err != nil {
			t.Fatal(err)
		}
	}
	span.End()
	flush(t, tp)
	relay := harness.StartProcess(t, e.Bin, e.Args("run", relayArgs(j, layout...)...), relayEnv)
	byID := map[string]harness.Record{}
	harness.ConsumeUntil(t, e.Brokers, harness.RelayTopics, 2*time.Minute, func(all []harness.Record) bool {
		for _, r := range all {
			byID[r.Headers["id"]] = r
		}
		return len(byID) == 2
	})
	stopRelay(t, relay)

	if r := byID[plain]; r.Headers["tracingspancontext"] != "" {
		t.Errorf("row without a span context: headers %v, want no tracingspancontext value", r.Headers)
	} else {
		checkRootRelaySpan(t, j, plain, r) // the default sampler starts a trace of its own
	}
	r := byID[traced]
	if r.Headers["tracingspancontext"] != props || r.Headers["tracestate"] != "vendor=1" {
		t.Errorf("tracingspancontext %q, tracestate %q: want the column as written and the writer's tracestate", r.Headers["tracingspancontext"], r.Headers["tracestate"])
	}
	relaySpan := parentSpanID(r.Headers["traceparent"])
	var spans []harness.JaegerSpan
	harness.WaitFor(t, time.Minute, "Jaeger holds the service and relay spans", func() bool {
		spans, _ = j.Trace(sc.TraceID().String())
		return len(spans) >= 2
	})
	var found bool
	for _, s := range spans {
		if s.SpanID == relaySpan {
			found = true
			if s.Service != relayName || s.Parent() != sc.SpanID().String() || s.Tag("outbox.event_id") != traced {
				t.Errorf("relay span %+v: want service %s, CHILD_OF the service span %s, event %s", s, relayName, sc.SpanID(), traced)
			}
		}
	}
	if !found || len(spans) != 2 {
		t.Errorf("trace %s: %d spans, relay span %s found %v; want the service's and the relay's", sc.TraceID(), len(spans), relaySpan, found)
	}
}

// A collector that is not there costs the relay nothing but a warning: it
// publishes as ever, and says in one JSON log line what to check, not in
// the SDK's plain text on stderr.
func TestUnreachableCollectorIsAWarning(t *testing.T) {
	j := harness.StartJaeger(t) // for the service's own spans only
	e := harness.NewRelayEnv(t, cluster, 3)
	e.Migrate()
	s := newService(t, e, j)
	if err := s.placeOrder(1, true); err != nil {
		t.Fatal(err)
	}
	dead := fmt.Sprintf("http://127.0.0.1:%d", harness.FreePort(t))
	relay := harness.StartProcess(t, e.Bin, e.Args("run", "--otel-traces-exporter", "otlp", "--otel-exporter-otlp-endpoint", dead),
		append(slices.Clone(relayEnv), "OTEL_EXPORTER_OTLP_TIMEOUT=300"))
	ids, _ := e.Committed()
	harness.ConsumeEventIDs(t, e.Brokers, harness.RelayTopics, ids, time.Minute)
	relay.WaitForOutput(t, "spans were not exported", time.Minute)
	stopRelay(t, relay)
	for _, line := range strings.Split(strings.TrimSpace(relay.Output()), "\n") {
		if !json.Valid([]byte(line)) {
			t.Errorf("the relay wrote a line that is no JSON: %q", line)
		}
	}
}

// Poll mode knows a row it claims again may be in Kafka already: after a
// failed attempt, the next relay span of the event says outbox.redelivery,
// and the failed one ends with an error status. Both are the service
// span's children in one trace.
func TestPollRetryIsMarkedAsARedelivery(t *testing.T) {
	j := harness.StartJaeger(t)
	e := harness.NewRelayEnv(t, cluster, 3)
	e.Source = "poll"
	e.Migrate()
	s := newService(t, e, j)
	if err := s.placeOrder(1, true); err != nil {
		t.Fatal(err)
	}
	flush(t, s.tp)
	// The first attempt and the producer's one retry fail, so the
	// poller records a failed attempt and claims the row again.
	fault := e.Kafka.FailProduce(2, kerr.NotLeaderForPartition.Code)
	defer fault.Remove()
	relay := harness.StartProcess(t, e.Bin, e.Args("run", relayArgs(j, "--kafka-retry-max", "1", "--poll-backoff-min", "100ms")...), relayEnv)
	ids, _ := e.Committed()
	harness.ConsumeEventIDs(t, e.Brokers, harness.RelayTopics, ids, time.Minute)
	stopRelay(t, relay)
	var sc trace.SpanContext
	for _, v := range s.traced {
		sc = v
	}
	var spans []harness.JaegerSpan
	harness.WaitFor(t, time.Minute, "Jaeger holds the service span and two relay spans", func() bool {
		spans, _ = j.Trace(sc.TraceID().String())
		return len(spans) >= 3
	})
	var failed, retried int
	for _, sp := range spans {
		if sp.Service != relayName {
			continue
		}
		if sp.Parent() != sc.SpanID().String() {
			t.Errorf("relay span %s is CHILD_OF %q, want the service span %s", sp.SpanID, sp.Parent(), sc.SpanID())
		}
		switch {
		case sp.Tag("otel.status_code") == "ERROR" && sp.Tag("outbox.redelivery") == "":
			failed++
		case sp.Tag("otel.status_code") == "" && sp.Tag("outbox.redelivery") == "true" && sp.Tag("messaging.kafka.offset") != "":
			retried++
		default:
			t.Errorf("relay span %+v: want a failed first attempt, or a re-delivery with its offset", sp)
		}
	}
	if failed != 1 || retried != 1 || len(spans) != 3 {
		t.Errorf("%d spans: %d failed attempts, %d re-deliveries; want the service span, one of each", len(spans), failed, retried)
	}
}
