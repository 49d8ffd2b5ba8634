package docgen

import (
	"bytes"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Metric is one series family as its collector describes it.
type Metric struct {
	Name, Help, Type string
	Labels           []string // variable labels
	ConstLabels      []string // constant labels, as name="value"
}

// recorder is a prometheus.Registerer that keeps the collectors it is
// given, so that a package's NewMetrics can be asked what it registers
// without a registry and without global state.
type recorder struct{ collectors []prometheus.Collector }

func (r *recorder) Register(c prometheus.Collector) error {
	r.collectors = append(r.collectors, c)
	return nil
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	r.collectors = append(r.collectors, cs...)
}

func (r *recorder) Unregister(prometheus.Collector) bool { return false }

// descPattern reads prometheus.Desc.String, the only way client_golang
// offers to read a descriptor's name, help and labels.
var descPattern = regexp.MustCompile(`^Desc\{fqName: ("(?:[^"\\]|\\.)*"), help: ("(?:[^"\\]|\\.)*"), (?:unit: "(?:[^"\\]|\\.)*", )?constLabels: \{(.*)\}, variableLabels: \{(.*)\}\}$`)

// parseDesc reads a descriptor's name, help and labels.
func parseDesc(d *prometheus.Desc) (Metric, error) {
	m := descPattern.FindStringSubmatch(d.String())
	if m == nil {
		return Metric{}, fmt.Errorf("cannot read the descriptor %s", d)
	}
	name, err := strconv.Unquote(m[1])
	if err != nil {
		return Metric{}, fmt.Errorf("descriptor %s: name: %w", d, err)
	}
	help, err := strconv.Unquote(m[2])
	if err != nil {
		return Metric{}, fmt.Errorf("descriptor %s: help: %w", d, err)
	}
	out := Metric{Name: name, Help: help}
	if m[3] != "" {
		out.ConstLabels = strings.Split(m[3], ",")
	}
	for _, l := range strings.Split(m[4], ",") {
		if l = strings.TrimSuffix(strings.TrimPrefix(l, "c("), ")"); l != "" {
			out.Labels = append(out.Labels, l)
		}
	}
	return out, nil
}

// typeOf is a metric's type, from a sample it collected.
func typeOf(m prometheus.Metric) (string, error) {
	var pb dto.Metric
	if err := m.Write(&pb); err != nil {
		return "", fmt.Errorf("write %s: %w", m.Desc(), err)
	}
	switch {
	case pb.Counter != nil:
		return "counter", nil
	case pb.Gauge != nil:
		return "gauge", nil
	case pb.Histogram != nil:
		return "histogram", nil
	case pb.Summary != nil:
		return "summary", nil
	}
	return "untyped", nil
}

// vecType is the type of a vector that has collected no sample yet.
func vecType(c prometheus.Collector) string {
	switch c.(type) {
	case *prometheus.CounterVec:
		return "counter"
	case *prometheus.GaugeVec:
		return "gauge"
	case *prometheus.HistogramVec:
		return "histogram"
	case *prometheus.SummaryVec:
		return "summary"
	}
	return "untyped"
}

// Describe lists the series that register registers, read from the
// collectors' descriptors: name, help, labels and type. Series whose name
// starts with one of skip (the Go and process collectors) are left out.
func Describe(register func(prometheus.Registerer), skip ...string) ([]Metric, error) {
	var rec recorder
	register(&rec)
	byName := map[string]Metric{}
	for _, c := range rec.collectors {
		types := map[*prometheus.Desc]string{}
		samples := make(chan prometheus.Metric)
		go func() {
			c.Collect(samples)
			close(samples)
		}()
		var err error
		for s := range samples {
			t, terr := typeOf(s)
			if terr != nil && err == nil {
				err = terr
			}
			types[s.Desc()] = t
		}
		if err != nil {
			return nil, err
		}
		descs := make(chan *prometheus.Desc)
		go func() {
			c.Describe(descs)
			close(descs)
		}()
		for d := range descs {
			m, derr := parseDesc(d)
			if derr != nil && err == nil {
				err = derr
			}
			if derr != nil || skipped(m.Name, skip) {
				continue
			}
			if m.Type = types[d]; m.Type == "" {
				m.Type = vecType(c)
			}
			if prev, ok := byName[m.Name]; ok {
				// One family from several collectors, such as one
				// series per constant label value: keep the labels of
				// each.
				prev.ConstLabels = append(prev.ConstLabels, m.ConstLabels...)
				m = prev
			}
			byName[m.Name] = m
		}
		if err != nil {
			return nil, err
		}
	}
	out := make([]Metric, 0, len(byName))
	for _, m := range byName {
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func skipped(name string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// Without is ms less the series whose names are in others.
func Without(ms []Metric, others ...[]Metric) []Metric {
	drop := map[string]bool{}
	for _, o := range others {
		for _, m := range o {
			drop[m.Name] = true
		}
	}
	var out []Metric
	for _, m := range ms {
		if !drop[m.Name] {
			out = append(out, m)
		}
	}
	return out
}

// MetricGroup is a section of the metric reference.
type MetricGroup struct {
	Title, Intro string
	Metrics      []Metric
}

// MetricsMarkdown is the metric reference page.
func MetricsMarkdown(intro string, groups []MetricGroup, outro string) []byte {
	var b bytes.Buffer
	b.WriteString(generatedNote)
	b.WriteString("# Metrics\n\n")
	b.WriteString(intro + "\n\n")
	for _, g := range groups {
		fmt.Fprintf(&b, "## %s\n\n%s\n\n| series | type | labels | meaning |\n|---|---|---|---|\n", g.Title, g.Intro)
		for _, m := range g.Metrics {
			labels := make([]string, 0, len(m.Labels)+len(m.ConstLabels))
			for _, l := range m.Labels {
				labels = append(labels, "`"+l+"`")
			}
			seen := map[string]bool{}
			for _, l := range m.ConstLabels {
				name, _, _ := strings.Cut(l, "=")
				if !seen[name] {
					labels = append(labels, "`"+name+"`")
					seen[name] = true
				}
			}
			fmt.Fprintf(&b, "| <span id=\"%s\"></span>`%s` | %s | %s | %s |\n", m.Name, m.Name, m.Type, strings.Join(labels, " "), mdCell(m.Help))
		}
		b.WriteString("\n")
	}
	if outro != "" {
		b.WriteString(outro + "\n")
	}
	return b.Bytes()
}
