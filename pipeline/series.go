package pipeline

import "github.com/prometheus/client_golang/prometheus"

// Series creates Prometheus series and registers each on its registerer
// as it is made, so that a source declares a series in one line and cannot
// forget to register it.
type Series struct{ reg prometheus.Registerer }

// NewSeries registers on reg; nil creates the series unregistered.
func NewSeries(reg prometheus.Registerer) Series { return Series{reg: reg} }

func (s Series) register(c prometheus.Collector) {
	if s.reg != nil {
		s.reg.MustRegister(c)
	}
}

// Counter is a new counter.
func (s Series) Counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	s.register(c)
	return c
}

// CounterVec is a new counter with labels.
func (s Series) CounterVec(name, help string, labels ...string) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
	s.register(c)
	return c
}

// Gauge is a new gauge.
func (s Series) Gauge(name, help string) prometheus.Gauge {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	s.register(g)
	return g
}

// GaugeVec is a new gauge with labels.
func (s Series) GaugeVec(name, help string, labels ...string) *prometheus.GaugeVec {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels)
	s.register(g)
	return g
}

// Latency is a new latency histogram, in seconds, with LatencyBuckets.
func (s Series) Latency(name, help string) prometheus.Histogram {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: LatencyBuckets})
	s.register(h)
	return h
}
