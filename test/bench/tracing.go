package main

import (
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// TracingResult is the tracing part: one relay build with tracing off, on
// (every span exported) and sampled at 1%, side by side on the same
// events, every one of which carries a traceparent.
type TracingResult struct {
	Method  string      `json:"method"`
	CatchUp []DrainRun  `json:"catch_up"`
	Steady  []SteadyRun `json:"steady"`
	// Spans are the spans the OTLP sink received, by setting.
	Spans map[string]int64 `json:"spans_exported"`
}

const tracingMethod = "every event carries a W3C traceparent whose sampled flag is set for 1% of trace ids (as a service sampling 1% writes them). " +
	"The same relay build runs with tracing off; on (OTEL_TRACES_EXPORTER=otlp, OTEL_TRACES_SAMPLER=always_on, OTLP/HTTP to a sink in the bench process that decodes and discards); " +
	"and sampled (parentbased_traceidratio 0.01, so the writer's 1% decides). Catch-up drains one backlog of single-row transactions per setting (slots created back to back); " +
	"the steady run commits single-row transactions at 2,000/s as the steady-rate part does. Settings run in turn, reversed on even repetitions, on the first broker"

// tracingRate is the steady rate the tracing part measures at.
const tracingRate = 2000

// tracingSetting is one way the relay runs in the tracing part.
type tracingSetting struct {
	name, service string
	env           []string
}

func tracingSettings(sink string) []tracingSetting {
	otlp := func(service string, env ...string) []string {
		return append([]string{"OTEL_TRACES_EXPORTER=otlp", "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT=" + sink, "OTEL_SERVICE_NAME=" + service}, env...)
	}
	return []tracingSetting{
		{name: "tracing off"},
		{name: "tracing on", service: "bench-on", env: otlp("bench-on", "OTEL_TRACES_SAMPLER=always_on")},
		{name: "sampled 1%", service: "bench-1pct", env: otlp("bench-1pct", "OTEL_TRACES_SAMPLER=parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG=0.01")},
	}
}

// tracedHeaders is the headers value of a traced event whose trace id is
// the md5 of t: sampled when the trace id's first 16 bits fall below 1%
// of their range.
const tracedHeaders = `jsonb_build_object('traceparent', '00-' || md5(t) || '-' || substr(md5(md5(t)), 1, 16) || '-' ||
	CASE WHEN ('x' || substr(md5(t), 1, 4))::bit(16)::int < 655 THEN '01' ELSE '00' END)`

// tracedFillProcedure is bench_fill with a traceparent on every row.
const tracedFillProcedure = `
CREATE OR REPLACE PROCEDURE bench_fill_traced(first bigint, n bigint, per_txn int, aggregates int, pad int)
LANGUAGE plpgsql AS $$
DECLARE
	i bigint := first;
BEGIN
	WHILE i < first + n LOOP
		INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
		SELECT gen_random_uuid(), 'order', 'agg-' || (g % aggregates), 'order.updated',
		       jsonb_build_object('seq', g, 'customer', 'cust-' || (g % 977), 'amount', (g % 100000) / 100.0,
		                          'currency', 'EUR', 'pad', repeat('x', pad)),
		       ` + tracedHeaders + `
		FROM generate_series(i, least(i + per_txn, first + n) - 1) AS g, LATERAL (SELECT g::text || random()::text AS t) r;
		COMMIT;
		i := i + per_txn;
	END LOOP;
END
$$`

// tracedInsertSQL is steadyInsertSQL with a traceparent, its trace id
// from the event id.
const tracedInsertSQL = `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
SELECT $1::uuid, 'order', $2, 'order.updated', $3::jsonb, ` + tracedHeaders + ` FROM (SELECT $1::text AS t) r`

// tracingPart measures what tracing costs the relay.
func (b *bench) tracingPart(ctx context.Context) (*TracingResult, error) {
	sink, err := startSpanSink()
	if err != nil {
		return nil, err
	}
	defer sink.close()
	res := &TracingResult{Method: tracingMethod}
	dsn, logDir, done, err := b.liveRelayDB(ctx, "bench_tracing")
	if err != nil {
		return nil, err
	}
	defer done()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	_, err = conn.Exec(ctx, tracedFillProcedure)
	conn.Close(context.Background())
	if err != nil {
		return nil, fmt.Errorf("create the traced fill procedure: %w", err)
	}
	pad, err := padFor(ctx, dsn, b.o.payload)
	if err != nil {
		return nil, err
	}
	steadyPad := b.o.payload - len(payloadJSON(0, 0))
	br := b.brokers[0]
	base := b.o.variants[0]
	settings := tracingSettings(sink.url)
	variants := make([]variant, len(settings))
	for i, s := range settings {
		variants[i] = variant{name: s.name, bin: base.bin, env: append(slices.Clone(base.env), s.env...)}
	}
	// Any other --variant runs beside them with tracing off: a build from
	// before tracing existed shows what off costs.
	for _, v := range b.o.variants[1:] {
		variants = append(variants, variant{name: "tracing off [" + v.name + "]", bin: v.bin, env: v.env})
	}
	rows := b.o.tracingRows
	for rep := 1; rep <= b.o.repeat; rep++ {
		slots := make([]string, len(variants))
		for i := range variants {
			slots[i] = relaySlot("tracing", br, i, rep)
		}
		if _, err := createSlots(ctx, dsn, slots); err != nil {
			return res, err
		}
		b.logf("tracing: %d traced rows, repetition %d", rows, rep)
		end, err := fillWith(ctx, dsn, "bench_fill_traced", rows, 1, b.o.prefillConns, b.o.aggregates, pad)
		if err != nil {
			return res, err
		}
		order := variantOrder(len(variants), rep)
		for _, i := range order {
			topic := fmt.Sprintf("bench.tracing.%s.%d.%d.%d", br.name, i, rep, time.Now().Unix())
			run, err := b.drainRelay(ctx, dsn, slots[i], br, topic, variants[i], rows, end, logDir)
			b.dropSlot(ctx, dsn, slots[i])
			if err != nil {
				return res, fmt.Errorf("tracing catch-up, %s: %w", variants[i].name, err)
			}
			run.Rep = rep
			b.logf("tracing catch-up #%d %s: %.0f events/s, %.2f µs CPU/event", rep, variants[i].name, run.EventsPerSec, run.CPUUsPerEvent)
			res.CatchUp = append(res.CatchUp, run)
		}
		for _, i := range order {
			run, err := b.steadyRelayWith(ctx, dsn, br, 100+i, variants[i], tracingRate, steadyPad, rep, logDir, tracedInsertSQL)
			if err != nil {
				return res, fmt.Errorf("tracing at %d/s, %s: %w", tracingRate, variants[i].name, err)
			}
			run.Rep = rep
			b.logSteady(run)
			res.Steady = append(res.Steady, run)
		}
	}
	res.Spans = map[string]int64{}
	for _, s := range settings {
		if s.service != "" {
			res.Spans[s.name] = sink.spans(s.service)
		}
	}
	return res, nil
}

// tracingMarkdown is the tracing part's table: each setting's catch-up
// rate and CPU, and its CPU and latency at 2,000/s, each beside its ratio
// to tracing off in the same repetition.
func (r *Results) tracingMarkdown(w func(string, ...any)) {
	t := r.Tracing
	if t == nil {
		return
	}
	w("\n## Tracing cost (`--skip` key `tracing`)\n\n%s.\n\n", t.Method)
	w("| setting | rep | catch-up events/s | ÷ off | catch-up CPU µs/event | ÷ off | %d/s CPU µs/event | ÷ off | %d/s p99 ms | spans exported |\n|---|---|---|---|---|---|---|---|---|---|\n", tracingRate, tracingRate)
	off := func(rep int) (DrainRun, SteadyRun) {
		var d DrainRun
		var s SteadyRun
		for _, x := range t.CatchUp {
			if x.Rep == rep && x.Variant == "tracing off" {
				d = x
			}
		}
		for _, x := range t.Steady {
			if x.Rep == rep && x.Variant == "tracing off" {
				s = x
			}
		}
		return d, s
	}
	ratio := func(a, b float64) string {
		if b == 0 {
			return "–"
		}
		return fmt.Sprintf("%.2f", a/b)
	}
	for _, d := range t.CatchUp {
		od, os := off(d.Rep)
		var s SteadyRun
		for _, x := range t.Steady {
			if x.Rep == d.Rep && x.Variant == d.Variant {
				s = x
			}
		}
		spans := "–"
		if n, ok := t.Spans[d.Variant]; ok {
			spans = fmt.Sprint(n)
		}
		w("| %s | %d | %.0f | %s | %.2f | %s | %.1f | %s | %.2f | %s |\n", d.Variant, d.Rep, d.EventsPerSec, ratio(d.EventsPerSec, od.EventsPerSec),
			d.CPUUsPerEvent, ratio(d.CPUUsPerEvent, od.CPUUsPerEvent), s.CPUUsPerEvent, ratio(s.CPUUsPerEvent, os.CPUUsPerEvent), s.P99Ms, spans)
	}
	w("\nSpans exported count every repetition, both the catch-up and the steady runs; with always_on the SDK's batch processor drops what overflows its queue (2,048 spans) while catching up.\n")
}

// spanSink is an OTLP/HTTP receiver that decodes each export, counts its
// spans by service.name, and discards them.
type spanSink struct {
	url string
	srv *http.Server
	mu  sync.Mutex
	n   map[string]int64
}

func startSpanSink() (*spanSink, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &spanSink{url: "http://" + ln.Addr().String(), n: map[string]int64{}}
	s.srv = &http.Server{Handler: http.HandlerFunc(s.export), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

func (s *spanSink) export(w http.ResponseWriter, r *http.Request) {
	var body io.Reader = r.Body
	if r.Header.Get("Content-Encoding") == "gzip" {
		gz, err := gzip.NewReader(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		defer gz.Close()
		body = gz
	}
	raw, err := io.ReadAll(body)
	var req coltracepb.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(raw, &req)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	for _, rs := range req.GetResourceSpans() {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			s.n[service] += int64(len(ss.GetSpans()))
		}
	}
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/x-protobuf")
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	_, _ = w.Write(out)
}

func (s *spanSink) spans(service string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n[service]
}

func (s *spanSink) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
}
