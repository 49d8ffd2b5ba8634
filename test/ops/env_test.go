package ops

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/twmb/franz-go/pkg/kgo"

	dto "github.com/prometheus/client_model/go"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// topics matches every topic the relay writes with its default template.
const topics = `^outbox\.event\.`

// env is one test's world: its own database (and so its own slot name),
// a Kafka cluster and the relay binary.
type env struct {
	t       *testing.T
	db      *harness.PGDatabase
	bin     string
	slot    string
	brokers string // what --kafka-brokers gets
	kafka   *harness.Kfake
}

// newEnv creates a database and, unless brokers is given, starts a plain
// kfake cluster.
func newEnv(t *testing.T) *env {
	t.Helper()
	e := newEnvNoKafka(t)
	e.kafka = harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: 3})
	e.brokers = e.kafka.BrokerList()
	return e
}

// newEnvNoKafka creates the database only; the test sets brokers.
func newEnvNoKafka(t *testing.T) *env {
	t.Helper()
	db := cluster.CreateTestDatabase(t)
	e := &env{t: t, db: db, bin: harness.BuildRelay(t), slot: db.Name()}
	t.Cleanup(func() {
		// Slots are cluster-wide; the relays were killed by their own
		// cleanups, which ran first.
		cluster.Exec(t, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", e.slot)
	})
	return e
}

// args are a command's flags for this env, connecting as the superuser.
func (e *env) args(cmd string, extra ...string) []string {
	return e.argsAs(e.db.DSN(), cmd, extra...)
}

// argsAs is args with another DSN.
func (e *env) argsAs(dsn, cmd string, extra ...string) []string {
	a := []string{cmd, "--pg-dsn", dsn, "--slot", e.slot}
	if cmd == "run" {
		a = append(a, "--kafka-brokers", e.brokers, "--admin-addr", "127.0.0.1:0")
	}
	return append(a, extra...)
}

// run runs a short command (migrate, status) to its end and returns its
// exit code and output.
func (e *env) run(args []string, envVars ...string) (int, string) {
	e.t.Helper()
	p := harness.StartProcess(e.t, e.bin, args, envVars)
	code, err := p.Wait(2 * time.Minute)
	if err != nil {
		e.t.Fatalf("%s: %v\n%s", args[0], err, p.Output())
	}
	return code, p.Output()
}

// migrate runs `outbox-relay migrate` as the superuser and fails the test
// unless it exits 0.
func (e *env) migrate(extra ...string) {
	e.t.Helper()
	if code, out := e.run(e.args("migrate", extra...)); code != 0 {
		e.t.Fatalf("migrate exited %d:\n%s", code, out)
	}
}

// relayProc is a running `outbox-relay run`.
type relayProc struct {
	*harness.Process
	t *testing.T
}

// start starts `outbox-relay run` with args (use e.args) and extra
// environment variables; it does not wait for anything.
func (e *env) start(args []string, envVars ...string) *relayProc {
	e.t.Helper()
	return &relayProc{Process: harness.StartProcess(e.t, e.bin, args, envVars), t: e.t}
}

// startStreaming starts the relay and waits until it streams.
func (e *env) startStreaming(extra ...string) *relayProc {
	e.t.Helper()
	p := e.start(e.args("run", extra...))
	p.WaitForOutput(e.t, `"message":"streaming"`, time.Minute)
	return p
}

var adminAddr = regexp.MustCompile(`"admin_addr":"([^"]+)"`)

// admin is the base URL of the relay's admin endpoint, from its log.
func (p *relayProc) admin() string {
	p.t.Helper()
	p.WaitForOutput(p.t, `"admin_addr"`, time.Minute)
	m := adminAddr.FindStringSubmatch(p.Output())
	if m == nil {
		p.t.Fatalf("no admin_addr in the relay's output:\n%s", p.Output())
	}
	return "http://" + m[1]
}

// get fetches a URL and returns the status code and body.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	return request(t, http.MethodGet, url)
}

func request(t *testing.T, method, url string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Timeout: 20 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, url, err)
	}
	return resp.StatusCode, string(body)
}

// scrape reads /metrics and parses it as Prometheus does.
func scrape(t *testing.T, base string) map[string]*dto.MetricFamily {
	t.Helper()
	code, body := get(t, base+"/metrics")
	if code != http.StatusOK {
		t.Fatalf("GET /metrics: %d %s", code, body)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse /metrics: %v\n%s", err, body)
	}
	return families
}

// value is the value of the series of family whose labels include every
// name=value pair in labels; ok is false when there is no such series.
func value(families map[string]*dto.MetricFamily, name string, labels ...string) (v float64, ok bool) {
	f := families[name]
	if f == nil {
		return 0, false
	}
next:
	for _, m := range f.Metric {
		have := map[string]string{}
		for _, l := range m.Label {
			have[l.GetName()] = l.GetValue()
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if have[labels[i]] != labels[i+1] {
				continue next
			}
		}
		switch {
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		case m.Untyped != nil:
			return m.Untyped.GetValue(), true
		}
	}
	return 0, false
}

// metric is value for tests that need the series to exist.
func metric(t *testing.T, base, name string, labels ...string) float64 {
	t.Helper()
	v, ok := value(scrape(t, base), name, labels...)
	if !ok {
		t.Fatalf("/metrics has no %s%v", name, labels)
	}
	return v
}

// insert commits n outbox events, one transaction each, for aggregate
// type aggType, and returns their event ids.
func insert(t *testing.T, dsn string, aggType string, n int) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("connect to insert events: %v", err)
	}
	defer conn.Close(context.Background())
	ids := make([]string, n)
	for i := range ids {
		ids[i] = harness.NewUUID()
		if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
			VALUES ($1, $2, $3, 'Happened', $4::jsonb)`, ids[i], aggType, fmt.Sprintf("agg-%d", i%7), fmt.Sprintf(`{"n": %d}`, i)); err != nil {
			t.Fatalf("insert event %d: %v", i, err)
		}
	}
	return ids
}

// consumeIDs reads the relay's topics with a franz-go client built with
// opts (TLS, SASL) until every id in want was seen, and fails the test at
// timeout. The plain case can use harness.ConsumeEventIDs instead.
func consumeIDs(t *testing.T, brokers []string, opts []kgo.Opt, want []string, timeout time.Duration) {
	t.Helper()
	missing := map[string]bool{}
	for _, id := range want {
		missing[id] = true
	}
	cl, err := kgo.NewClient(append([]kgo.Opt{
		kgo.SeedBrokers(brokers...),
		kgo.ConsumeRegex(), kgo.ConsumeTopics(topics),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.MetadataMinAge(50 * time.Millisecond), kgo.MetadataMaxAge(250 * time.Millisecond),
		kgo.FetchMaxWait(200 * time.Millisecond),
	}, opts...)...)
	if err != nil {
		t.Fatalf("kafka consumer: %v", err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var lastErr error
	for len(missing) > 0 && ctx.Err() == nil {
		fetches := cl.PollFetches(ctx)
		fetches.EachError(func(_ string, _ int32, err error) {
			if ctx.Err() == nil {
				lastErr = err
			}
		})
		fetches.EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == harness.EventIDHeader {
					delete(missing, string(h.Value))
				}
			}
		})
	}
	if len(missing) > 0 {
		t.Fatalf("%d of %d events never reached Kafka within %v (last fetch error: %v)", len(missing), len(want), timeout, lastErr)
	}
}

// lastLines is the tail of a process's output, for failure messages.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
