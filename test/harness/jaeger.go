package harness

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// JaegerVersion is the Jaeger release test/tracing/jaeger/fetch.sh builds,
// which its go.mod pins (a test checks they agree).
const JaegerVersion = "v1.75.0"

// RequireJaegerEnv names the environment variable that, when "1", makes
// StartJaeger fail a test instead of skipping it when the Jaeger binary has
// not been built. CI sets it.
const RequireJaegerEnv = "OUTBOX_RELAY_REQUIRE_JAEGER"

// JaegerBinary is where test/tracing/jaeger/fetch.sh leaves the binary.
func JaegerBinary() string {
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache")
	}
	return filepath.Join(cache, "outbox-relay", "jaeger-"+JaegerVersion, "jaeger")
}

// Jaeger is a Jaeger all-in-one (v2) with in-memory storage, its OTLP
// receivers and its query API all on 127.0.0.1.
type Jaeger struct {
	proc                 *Process
	otlpHTTP, otlpGRPC   int
	queryHTTP, queryGRPC int
}

// jaegerConfig sets every endpoint: the built-in all-in-one config binds
// the query ports to every interface.
const jaegerConfig = `service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:%d
    grpc:
      endpoint: 127.0.0.1:%d
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:%d
      http:
        endpoint: 127.0.0.1:%d
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
`

// StartJaeger starts a Jaeger for the test, stopped when it ends. Without
// the binary the test is skipped, or failed with RequireJaegerEnv=1.
func StartJaeger(t testing.TB) *Jaeger {
	t.Helper()
	bin := JaegerBinary()
	if _, err := os.Stat(bin); err != nil {
		msg := fmt.Sprintf("Jaeger %s is not built (%v)\nto fix: run test/tracing/jaeger/fetch.sh (it builds cmd/jaeger from the Go module proxy, minutes the first time)", JaegerVersion, err)
		if os.Getenv(RequireJaegerEnv) == "1" {
			t.Fatalf("%s\n(%s=1: a missing Jaeger fails the test)", msg, RequireJaegerEnv)
		}
		t.Skipf("SKIPPING: %s\n(set %s=1 to make this a failure instead of a skip)", msg, RequireJaegerEnv)
	}
	j := &Jaeger{queryHTTP: FreePort(t), queryGRPC: FreePort(t), otlpGRPC: FreePort(t), otlpHTTP: FreePort(t)}
	config := filepath.Join(t.TempDir(), "jaeger.yaml")
	if err := os.WriteFile(config, fmt.Appendf(nil, jaegerConfig, j.queryHTTP, j.queryGRPC, j.otlpGRPC, j.otlpHTTP), 0o600); err != nil {
		t.Fatal(err)
	}
	j.proc = StartProcess(t, bin, []string{"--config", config}, nil)
	client := http.Client{Timeout: 2 * time.Second}
	WaitFor(t, time.Minute, "Jaeger's query API to answer", func() bool {
		if j.proc.Exited() {
			t.Fatalf("jaeger exited:\n%s", LastLines(j.proc.Output(), 30))
		}
		resp, err := client.Get(j.QueryURL() + "/api/services")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return j
}

// OTLPHTTPEndpoint is the OTLP/HTTP receiver's base URL, for
// OTEL_EXPORTER_OTLP_ENDPOINT.
func (j *Jaeger) OTLPHTTPEndpoint() string { return fmt.Sprintf("http://127.0.0.1:%d", j.otlpHTTP) }

// OTLPGRPCEndpoint is the OTLP/gRPC receiver's URL.
func (j *Jaeger) OTLPGRPCEndpoint() string { return fmt.Sprintf("http://127.0.0.1:%d", j.otlpGRPC) }

// QueryURL is the query API's base URL.
func (j *Jaeger) QueryURL() string { return fmt.Sprintf("http://127.0.0.1:%d", j.queryHTTP) }

// JaegerSpan is one span of a trace as the query API returns it.
type JaegerSpan struct {
	TraceID       string `json:"traceID"`
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		TraceID string `json:"traceID"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	StartTime int64 `json:"startTime"` // µs since the epoch
	Duration  int64 `json:"duration"`  // µs
	Tags      []struct {
		Key   string `json:"key"`
		Value any    `json:"value"`
	} `json:"tags"`
	ProcessID string `json:"processID"`
	// Service is the process's service name, filled in by Trace.
	Service string `json:"-"`
}

// Parent is the span's CHILD_OF reference, "" for a root.
func (s JaegerSpan) Parent() string {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

// Tag is the value of the named tag as text, "" when absent.
func (s JaegerSpan) Tag(key string) string {
	for _, t := range s.Tags {
		if t.Key == key {
			return fmt.Sprint(t.Value)
		}
	}
	return ""
}

// Trace returns the spans Jaeger holds of traceID (32 hex digits); none
// while it has not stored the trace yet.
func (j *Jaeger) Trace(traceID string) ([]JaegerSpan, error) {
	client := http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get(j.QueryURL() + "/api/traces/" + traceID)
	if err != nil {
		return nil, fmt.Errorf("query trace %s: %w", traceID, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("query trace %s: %w", traceID, err)
	}
	if resp.StatusCode == http.StatusNotFound {
		return nil, nil
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("query trace %s: %s: %s", traceID, resp.Status, strings.TrimSpace(string(body)))
	}
	var doc struct {
		Data []struct {
			Spans     []JaegerSpan `json:"spans"`
			Processes map[string]struct {
				ServiceName string `json:"serviceName"`
			} `json:"processes"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &doc); err != nil {
		return nil, fmt.Errorf("query trace %s: %w", traceID, err)
	}
	var spans []JaegerSpan
	for _, d := range doc.Data {
		for _, s := range d.Spans {
			s.Service = d.Processes[s.ProcessID].ServiceName
			spans = append(spans, s)
		}
	}
	return spans, nil
}
