package harness

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// HTTPRequest sends a bodiless request and returns the status code and
// body; a transport error fails the test.
func HTTPRequest(t testing.TB, method, url string) (status int, body string) {
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
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, url, err)
	}
	return resp.StatusCode, string(b)
}

// HTTPGet is HTTPRequest with GET.
func HTTPGet(t testing.TB, url string) (status int, body string) {
	t.Helper()
	return HTTPRequest(t, http.MethodGet, url)
}

// Scrape reads baseURL/metrics and parses it as Prometheus does.
func Scrape(t testing.TB, baseURL string) map[string]*dto.MetricFamily {
	t.Helper()
	code, body := HTTPGet(t, baseURL+"/metrics")
	if code != http.StatusOK {
		t.Fatalf("GET %s/metrics: %d %s", baseURL, code, body)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse %s/metrics: %v\n%s", baseURL, err, body)
	}
	return families
}

// MetricValue is the value of the first series of family name whose labels
// include every name, value pair in labels (a histogram gives its sample
// count); ok is false when there is no such series.
func MetricValue(families map[string]*dto.MetricFamily, name string, labels ...string) (v float64, ok bool) {
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

// Metric scrapes baseURL and returns the series MetricValue finds; no such
// series fails the test.
func Metric(t testing.TB, baseURL, name string, labels ...string) float64 {
	t.Helper()
	v, ok := MetricValue(Scrape(t, baseURL), name, labels...)
	if !ok {
		t.Fatalf("%s/metrics has no %s%v", baseURL, name, labels)
	}
	return v
}
