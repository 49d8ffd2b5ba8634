package publisher

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"
	metrics "github.com/rcrowley/go-metrics"
	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/sink"
)

// Golden vectors from Kafka's UtilsTest.testMurmur2: placement must match the
// Java client exactly, or aggregates move partition when a team switches from
// Debezium or a Java producer.
func TestMurmur2MatchesKafkaVectors(t *testing.T) {
	for key, want := range map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
		"":    275646681,
	} {
		if got := murmur2([]byte(key)); got != want {
			t.Errorf("murmur2(%q) = %d, want %d", key, got, want)
		}
	}
}

func TestJavaPartitionIsNonNegativeModulo(t *testing.T) {
	// toPositive(-790332482) = 1357151166; 1357151166 % 50 = 16.
	if got := JavaPartition([]byte("foobar"), 50); got != 16 {
		t.Fatalf("JavaPartition(foobar, 50) = %d, want 16", got)
	}
	p := javaPartitioner{}
	msg := &sarama.ProducerMessage{Topic: "t", Key: sarama.StringEncoder("foobar")}
	if got, err := p.Partition(msg, 50); err != nil || got != 16 {
		t.Fatalf("partitioner: %d, %v", got, err)
	}
	if _, err := p.Partition(&sarama.ProducerMessage{Topic: "t"}, 3); err == nil {
		t.Fatal("partitioner accepted a record without key")
	}
	if !p.RequiresConsistency() {
		t.Fatal("partitioner must require consistency")
	}
}

func sampleEvent() *event.Event {
	return &event.Event{
		EventID:       []byte("0b7e7f2e-6d5f-4c1e-9b7a-2f0d6c1a9e01"),
		AggregateType: []byte("order"),
		AggregateID:   []byte("order-42"),
		EventType:     []byte("OrderPlaced"),
		SchemaVersion: []byte("3"),
		Payload:       []byte(`{"total": 12.5}`),
		Headers:       []byte(`{"tenant": "acme", "retries": 2, "traceparent": "00-abc-def-01", "nothing": null}`),
		OccurredAt:    []byte("2026-11-29 21:03:56.123456+00"),
		Txn:           7,
	}
}

func headerMap(r *Record) map[string]string {
	m := map[string]string{}
	for _, h := range r.msg.Headers {
		m[string(h.Key)] = string(h.Value)
	}
	return m
}

// BuildRecord builds the record on the topic it is handed: the key, the
// value, every header, its size, and the way back to the record.
func TestBuildRecord(t *testing.T) {
	r, err := BuildRecord(sampleEvent(), "outbox.event.order")
	if err != nil {
		t.Fatal(err)
	}
	key, _ := r.msg.Key.Encode()
	value, _ := r.msg.Value.Encode()
	if string(key) != "order-42" || string(value) != `{"total": 12.5}` || r.msg.Topic != "outbox.event.order" {
		t.Fatalf("key %q value %q topic %q", key, value, r.msg.Topic)
	}
	want := map[string]string{
		"event_id": "0b7e7f2e-6d5f-4c1e-9b7a-2f0d6c1a9e01", "event_type": "OrderPlaced", "aggregate_type": "order",
		"aggregate_id": "order-42", "schema_version": "3", "occurred_at": "2026-11-29T21:03:56.123456Z",
		"tenant": "acme", "retries": "2", "traceparent": "00-abc-def-01", "nothing": "",
	}
	got := headerMap(r)
	if len(got) != len(want) {
		t.Fatalf("headers %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("header %s = %q, want %q", k, got[k], v)
		}
	}
	if r.Size() != r.msg.ByteSize(2) || r.Size() < len(value) {
		t.Fatalf("size %d", r.Size())
	}
	if r.msg.Metadata.(*Record) != r || r.txn != 7 {
		t.Fatal("metadata does not point back at the record")
	}
}

// The builder copies what sarama keeps: the event's slices alias a read
// buffer that is overwritten by the next WAL message.
func TestBuildCopiesInput(t *testing.T) {
	ev := sampleEvent()
	r, err := build(ev, "t")
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range [][]byte{ev.EventID, ev.AggregateID, ev.Payload, ev.Headers, ev.OccurredAt, ev.EventType} {
		for i := range b {
			b[i] = 'X'
		}
	}
	key, _ := r.msg.Key.Encode()
	if string(key) != "order-42" || headerMap(r)["tenant"] != "acme" || headerMap(r)["event_type"] != "OrderPlaced" {
		t.Fatalf("record changed with its input: key %q headers %v", key, headerMap(r))
	}
}

func TestBuildManyHeaders(t *testing.T) {
	ev := sampleEvent()
	var parts []string
	for i := 0; i < 20; i++ {
		parts = append(parts, fmt.Sprintf(`"h%d": "v%d"`, i, i))
	}
	ev.Headers = []byte("{" + strings.Join(parts, ",") + "}")
	r, err := build(ev, "t")
	if err != nil {
		t.Fatal(err)
	}
	if len(r.msg.Headers) != 26 || headerMap(r)["h19"] != "v19" {
		t.Fatalf("headers %v", headerMap(r))
	}
}

func TestBuildRejectsBadHeaders(t *testing.T) {
	for _, h := range []string{`[1,2]`, `"x"`, `{"event_id": "spoof"}`, `{"a": }`} {
		ev := sampleEvent()
		ev.Headers = []byte(h)
		if _, err := build(ev, "t"); err == nil {
			t.Errorf("headers %s accepted", h)
		}
	}
	ev := sampleEvent()
	ev.Headers = nil
	if r, err := build(ev, "t"); err != nil || len(r.msg.Headers) != 6 {
		t.Fatalf("no headers: %v", err)
	}
}

// The decode-and-build path must stay at two allocations per event: the
// record and its byte buffer.
func TestBuildAllocations(t *testing.T) {
	ev := sampleEvent()
	ev.Headers = nil
	ev.Layout = layout.Relay // as the relay sets it: the shape's dispatch is on the path
	allocs := testing.AllocsPerRun(1000, func() {
		if _, err := build(ev, "t"); err != nil {
			t.Fatal(err)
		}
	})
	if allocs > 2 {
		t.Fatalf("build allocates %.1f times per event, want at most 2", allocs)
	}
}

func TestTopicTemplate(t *testing.T) {
	ev := sampleEvent()
	for tmpl, want := range map[string]string{
		"outbox.event.{aggregate_type}": "outbox.event.order",
		"events":                        "events",
		"{aggregate_type}.{event_type}": "order.OrderPlaced",
		"prefix-{event_type}-suffix":    "prefix-OrderPlaced-suffix",
	} {
		tt, err := parseTopicTemplate(tmpl)
		if err != nil {
			t.Fatalf("%s: %v", tmpl, err)
		}
		if got := string(tt.appendName(nil, ev)); got != want {
			t.Errorf("%s -> %q, want %q", tmpl, got, want)
		}
	}
	for _, bad := range []string{"", "x.{nope}", "x.{aggregate_type", "bad topic", ".."} {
		if _, err := parseTopicTemplate(bad); err == nil {
			t.Errorf("template %q accepted", bad)
		}
	}
}

func TestValidTopicName(t *testing.T) {
	if err := validTopicName("ok.name_1-x"); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"", ".", "..", "has space", "ümlaut", strings.Repeat("x", 250)} {
		if err := validTopicName(bad); err == nil || !errors.Is(err, errInvalidTopicName) {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

// The brokers' throttle times, which sarama records per broker, reach the
// Throttle's observer; other histograms stay no-ops.
func TestThrottleTimesAreCounted(t *testing.T) {
	th := NewThrottle(zerolog.Nop())
	var total time.Duration
	th.Observe(func(d time.Duration) { total += d })
	r := newDiscardMetrics(th)
	newHistogram := func() metrics.Histogram { return metrics.NewHistogram(metrics.NewUniformSample(10)) }
	h, ok := r.GetOrRegister("throttle-time-in-ms-for-broker-1", newHistogram).(metrics.Histogram)
	if !ok {
		t.Fatal("the throttle histogram is not a histogram")
	}
	h.Update(250)
	h.Update(750)
	if _, ok := r.GetOrRegister("request-latency-in-ms-for-broker-1", newHistogram).(metrics.NilHistogram); !ok {
		t.Error("another histogram is not a no-op")
	}
	if total != time.Second {
		t.Fatalf("throttled %v, want 1s", total)
	}
}

func TestClassify(t *testing.T) {
	for err, want := range map[error]sink.Class{
		sarama.ErrMessageSizeTooLarge:                     sink.ClassPermanent,
		sarama.ErrInvalidTopic:                            sink.ClassPermanent,
		sarama.ErrTopicAuthorizationFailed:                sink.ClassPermanent,
		sarama.ErrUnknownTopicOrPartition:                 sink.ClassRetriable,
		sarama.ConfigurationError("too large"):            sink.ClassPermanent,
		sarama.ErrOutOfOrderSequenceNumber:                sink.ClassProducer,
		sarama.ErrInvalidProducerEpoch:                    sink.ClassProducer,
		sarama.ErrNotLeaderForPartition:                   sink.ClassRetriable,
		sarama.ErrNotEnoughReplicas:                       sink.ClassRetriable,
		sarama.ErrRequestTimedOut:                         sink.ClassRetriable,
		errors.New("dial tcp: connection refused"):        sink.ClassRetriable,
		fmt.Errorf("wrapped: %w", sarama.ErrInvalidTopic): sink.ClassPermanent,
	} {
		if got := Classify(err); got != want {
			t.Errorf("Classify(%v) = %s, want %s", err, got, want)
		}
	}
}

func TestErrorNamesEventTopicAndAdvice(t *testing.T) {
	e := recordError(sink.ClassPermanent, "abc", "t", 3, sarama.ErrMessageSizeTooLarge, nil)
	msg := sink.Explain(e)
	for _, want := range []string{"abc", "topic t partition 3", "max.message.bytes"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q lacks %q", msg, want)
		}
	}
}

// Error() carried its advice, so the advice went wherever the message
// went: into every wrap, beside log lines that said the same, and twice
// into the message of an *Error wrapped inside another. The message now
// leaves the advice out, and sink.Explain, which the places an operator reads
// call, gives it once: as is, wrapped with %w, or inside another *Error.
func TestExplainGivesTheAdviceOnce(t *testing.T) {
	ev := sampleEvent()
	unmapped := sink.UnmappedRow(ev, `no column "aggregate_id"`, stringer("0/16B3748"))
	size := recordError(sink.ClassPermanent, "abc", "t", -1, &LocalSizeError{Size: 5000, Limit: 3900, TopicMax: 4000, ProducerMax: 1000000}, nil)
	retriable := recordError(sink.ClassRetriable, "abc", "t", 2, sarama.ErrNotLeaderForPartition, nil)
	for name, perr := range map[string]*sink.Error{"unmapped row": unmapped, "local size": size, "retriable": retriable} {
		advice := perr.Advice()
		for how, err := range map[string]error{
			"as is":          perr,
			"wrapped":        fmt.Errorf("session: %w", fmt.Errorf("publish: %w", perr)),
			"inside another": recordError(perr.Class, perr.EventID, perr.Topic, -1, fmt.Errorf("replay: %w", perr), nil),
		} {
			if strings.Contains(err.Error(), advice) {
				t.Errorf("%s, %s: the message carries the advice: %s", name, how, err)
			}
			if got := strings.Count(sink.Explain(err), advice); got != 1 {
				t.Errorf("%s, %s: the advice appears %d times in %q", name, how, got, sink.Explain(err))
			}
		}
	}
	if sink.Explain(errors.New("plain")) != "plain" || sink.Explain(nil) != "" {
		t.Error("sink.Explain changes an error that is not a publisher error")
	}
}

type stringer string

func (s stringer) String() string { return string(s) }

// A row with a couple of headers (tenant, traceparent) costs no more
// allocations than one without.
func TestBuildWithHeadersAllocations(t *testing.T) {
	ev := sampleEvent()
	ev.Headers = []byte(`{"tenant": "acme", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`)
	ev.Layout = layout.Relay
	allocs := testing.AllocsPerRun(1000, func() {
		if _, err := build(ev, "t"); err != nil {
			t.Fatal(err)
		}
	})
	if allocs > 2 {
		t.Fatalf("build with two headers allocates %.1f times per event, want at most 2", allocs)
	}
}

func TestDiscardMetricsHandsOutNoOps(t *testing.T) {
	r := newDiscardMetrics(nil)
	if _, ok := r.GetOrRegister("m", metrics.NewMeter).(metrics.NilMeter); !ok {
		t.Error("meter is not a no-op")
	}
	if _, ok := r.GetOrRegister("c", metrics.NewCounter).(metrics.NilCounter); !ok {
		t.Error("counter is not a no-op")
	}
	h := r.GetOrRegister("h", func() metrics.Histogram { return metrics.NewHistogram(metrics.NewUniformSample(10)) })
	if _, ok := h.(metrics.NilHistogram); !ok {
		t.Error("histogram is not a no-op")
	}
	// An unknown kind still gets a working metric.
	if r.GetOrRegister("e", metrics.NewEWMA1) == nil {
		t.Error("unknown kind got nothing")
	}
}

// The producer settings the delivery promises rest on, and the linger knob.
func TestSaramaConfig(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Brokers = []string{"127.0.0.1:9092"}
	sc, err := saramaConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !sc.Producer.Idempotent || sc.Producer.RequiredAcks != sarama.WaitForAll || sc.Net.MaxOpenRequests != 1 {
		t.Errorf("idempotent %t, acks %d, max open requests %d: want an idempotent producer, acks=all, one request in flight",
			sc.Producer.Idempotent, sc.Producer.RequiredAcks, sc.Net.MaxOpenRequests)
	}
	if sc.Producer.Flush.Frequency != 2*time.Millisecond {
		t.Errorf("Flush.Frequency %v, want the default 2ms linger", sc.Producer.Flush.Frequency)
	}
	if sc.Producer.Compression != sarama.CompressionLZ4 {
		t.Errorf("compression %v, want lz4 by default", sc.Producer.Compression)
	}
}

// An order break is counted only when the failed record may have been in a
// produce request while later records of its partition were appended. A
// broker outage seen as "circuit breaker is open" or "run out of available
// brokers" fails records before that (issue: 16 false order breaks after a
// 12 s outage).
func TestOrderMayBreak(t *testing.T) {
	for _, c := range []struct {
		name      string
		partition int32
		err       error
		want      bool
	}{
		{"never reached a partition", -1, sarama.ErrOutOfOrderSequenceNumber, false},
		{"circuit breaker open", 0, breaker.ErrBreakerOpen, false},
		{"out of brokers", 3, sarama.ErrOutOfBrokers, false},
		{"not connected", 3, sarama.ErrNotConnected, false},
		{"local size check", 0, &LocalSizeError{Size: 10, Limit: 5}, false},
		{"out of order sequence", 1, sarama.ErrOutOfOrderSequenceNumber, true},
		{"retries exhausted on a broker answer", 2, sarama.ErrNotLeaderForPartition, true},
		{"request timed out", 0, sarama.ErrRequestTimedOut, true},
		{"wrapped breaker", 0, fmt.Errorf("produce: %w", breaker.ErrBreakerOpen), false},
	} {
		e := recordError(Classify(c.err), "", "t", c.partition, c.err, nil)
		if got := e.OrderMayBreak; got != c.want {
			t.Errorf("%s: OrderMayBreak = %t, want %t", c.name, got, c.want)
		}
	}
}

// A record refused by the publisher's own size check says so; it must not
// read as the broker's "Message was too large".
func TestLocalSizeCheckIsNotABrokerError(t *testing.T) {
	topics, err := parseTopicTemplate("outbox.{aggregate_type}")
	if err != nil {
		t.Fatal(err)
	}
	r := newTopicResolver(Config{MaxMessageBytes: 1000}, zerolog.Nop(), topics, nil, nil)
	r.known["outbox.order"] = &topicInfo{name: "outbox.order", maxBytes: 300}
	ev := sampleEvent()
	ev.Payload = []byte(`"` + strings.Repeat("x", 400) + `"`)
	_, err = r.build(ev)
	var perr *sink.Error
	if !errors.As(err, &perr) || perr.Class != sink.ClassPermanent || perr.Partition != -1 {
		t.Fatalf("Build: %v, want a permanent error before any partition", err)
	}
	msg := perr.Error()
	if strings.Contains(msg, "kafka server") || !strings.Contains(msg, "before sending") {
		t.Fatalf("error %q reads as a broker's answer", msg)
	}
	if !strings.Contains(perr.Advice(), "max.message.bytes") || Classify(perr.Err) != sink.ClassPermanent {
		t.Fatalf("advice %q / class %s", perr.Advice(), Classify(perr.Err))
	}
}

// A missing topic (auto-create off) is looked up in the background, once:
// Build never blocks, and later events for the same topic fail at once from
// the cache instead of waiting TopicWait each (issue: four events to a
// missing topic delayed an unrelated event by 42 s).
func TestMissingTopicLookedUpOnceInBackground(t *testing.T) {
	cfg, p := kfakePublisher(t, 500*time.Millisecond)

	missing := sampleEvent()
	missing.AggregateType = []byte("nosuch")
	start := time.Now()
	_, err := p.Build(missing)
	var pending *sink.TopicPendingError
	if !errors.As(err, &pending) || pending.Topic != "outbox.nosuch" {
		t.Fatalf("first Build for a new topic: %v, want a pending lookup", err)
	}
	if d := time.Since(start); d > cfg.TopicWait/2 {
		t.Fatalf("Build blocked %v on a topic lookup", d)
	}
	select {
	case <-pending.Done:
	case <-time.After(10 * cfg.TopicWait):
		t.Fatal("lookup did not finish")
	}
	for i := range 4 {
		missing.EventID = []byte(fmt.Sprintf("event-%d", i))
		before := time.Now()
		_, err := p.Build(missing)
		var perr *sink.Error
		if !errors.As(err, &perr) || !errors.Is(err, sarama.ErrUnknownTopicOrPartition) || perr.EventID != string(missing.EventID) {
			t.Fatalf("Build %d for a missing topic: %v, want a permanent unknown-topic error for its own event", i, err)
		}
		if d := time.Since(before); d > cfg.TopicWait/2 {
			t.Fatalf("Build %d for a topic known missing took %v", i, d)
		}
	}
	if _, err := p.BuildWait(context.Background(), sampleEvent()); err != nil {
		t.Fatalf("an event for an existing topic: %v", err)
	}
	if d := time.Since(start); d > 3*cfg.TopicWait {
		t.Fatalf("five events, four to a missing topic, took %v; want about one TopicWait (%v)", d, cfg.TopicWait)
	}
}

// Sends go through Input and every outcome comes back on Outcomes, with
// the event's transaction; nothing calls back into the caller.
func TestOutcomesComeBackOverTheChannel(t *testing.T) {
	_, p := kfakePublisher(t, DefaultConfig().TopicWait)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 100
	for i, r := range buildNumbered(ctx, t, p, n) {
		select {
		case p.Input() <- sink.Item{Record: r}:
		case <-ctx.Done():
			t.Fatalf("record %d of %d: the producer did not take it", i, n)
		}
	}
	seen := map[uint64]bool{}
	for len(seen) < n {
		select {
		case o := <-p.Outcomes():
			if o.Err != nil {
				t.Fatalf("outcome error: %v", o.Err)
			}
			if o.Partition < 0 || o.At.IsZero() || seen[o.Txn] {
				t.Fatalf("outcome %+v: want a partition, a time and each txn once", o.Delivery)
			}
			seen[o.Txn] = true
		case <-ctx.Done():
			t.Fatalf("%d of %d outcomes", len(seen), n)
		}
	}
	if err := p.Close(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if _, open := <-p.Outcomes(); open {
		t.Fatal("Outcomes still open after Close")
	}
}

// buildNumbered builds n records of events e-0… in transactions 0…
func buildNumbered(ctx context.Context, t *testing.T, p *Publisher, n int) []*Record {
	t.Helper()
	recs := make([]*Record, n)
	for i := range recs {
		ev := sampleEvent()
		ev.EventID = []byte(fmt.Sprintf("e-%d", i))
		ev.Txn = uint64(i)
		r, err := p.BuildWait(ctx, ev)
		if err != nil {
			t.Fatal(err)
		}
		recs[i] = r.(*Record)
	}
	return recs
}

// kfakePublisher is a publisher on an in-process kfake cluster (auto-create
// off) holding the topic outbox.order, closed when the test ends.
func kfakePublisher(t *testing.T, topicWait time.Duration) (Config, *Publisher) {
	t.Helper()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, "outbox.order"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	cfg := DefaultConfig()
	cfg.Brokers = cluster.ListenAddrs()
	cfg.TopicTemplate = "outbox.{aggregate_type}"
	cfg.TopicWait = topicWait
	p, err := New(cfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close(5 * time.Second) })
	return cfg, p
}

// A sink abandoned after a Kafka failure may be closed by the goroutine
// that drains it and by the session's end at once. sarama's client panics
// on a second, concurrent close ("close of closed channel"), which crashed
// a drill's relay; Close must be safe to call twice at the same time.
func TestCloseTwiceAtOnce(t *testing.T) {
	cfg, _ := kfakePublisher(t, DefaultConfig().TopicWait)
	// 2,000 rounds: without the fix the race showed within them; 20 were not enough.
	for range 2000 {
		p, err := New(cfg, zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		start := make(chan struct{})
		var done sync.WaitGroup
		for range 2 {
			done.Add(1)
			go func() {
				defer done.Done()
				<-start
				p.Close(time.Second)
			}()
		}
		close(start)
		done.Wait()
	}
}
