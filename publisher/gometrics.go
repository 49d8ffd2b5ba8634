package publisher

import (
	metrics "github.com/rcrowley/go-metrics"
)

// discardMetrics is a go-metrics registry that gives sarama no-op meters,
// counters and histograms. sarama records per-request metrics that the relay
// never reads (it exports its own through Prometheus); each meter also starts
// a ticker. Disabling them per producer avoids go-metrics' process-wide
// UseNilMetrics switch.
// Kinds it does not know go to a real registry, so a newer sarama keeps
// working.
// The brokers' throttle times are the exception: they go to throttle.
type discardMetrics struct {
	fallback metrics.Registry
	throttle *Throttle
}

func newDiscardMetrics(throttle *Throttle) *discardMetrics {
	return &discardMetrics{fallback: metrics.NewRegistry(), throttle: throttle}
}

func (d *discardMetrics) GetOrRegister(name string, metric any) any {
	switch metric.(type) {
	case func() metrics.Histogram, metrics.Histogram:
		if d.throttle != nil && isThrottleMetric(name) {
			return throttleHistogram{t: d.throttle}
		}
	}
	switch metric.(type) {
	case func() metrics.Meter, metrics.Meter:
		return metrics.NilMeter{}
	case func() metrics.Counter, metrics.Counter:
		return metrics.NilCounter{}
	case func() metrics.Histogram, metrics.Histogram:
		return metrics.NilHistogram{}
	case func() metrics.Gauge, metrics.Gauge:
		return metrics.NilGauge{}
	case func() metrics.Timer, metrics.Timer:
		return metrics.NilTimer{}
	}
	return d.fallback.GetOrRegister(name, metric)
}

func (discardMetrics) Each(func(string, any))            {}
func (discardMetrics) Get(string) any                    { return nil }
func (discardMetrics) GetAll() map[string]map[string]any { return nil }
func (discardMetrics) Register(string, any) error        { return nil }
func (discardMetrics) RunHealthchecks()                  {}
func (discardMetrics) Unregister(string)                 {}
func (discardMetrics) UnregisterAll()                    {}
