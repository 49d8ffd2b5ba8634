package reconcile

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the series of the periodic check.
type Metrics struct {
	MissingEvents prometheus.Gauge
	Phantoms      prometheus.Gauge
	LastComplete  prometheus.Gauge
	Failures      prometheus.Counter
	// Interval is --reconcile-every in seconds, 0 when the check is off,
	// so an alert can tell a stale check from a disabled one.
	Interval prometheus.Gauge
}

// NewMetrics creates the series and registers them on reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		MissingEvents: prometheus.NewGauge(prometheus.GaugeOpts{Name: "outbox_relay_reconcile_missing_events",
			Help: "Outbox rows the last complete periodic check found missing from Kafka (not quarantined)."}),
		Phantoms: prometheus.NewGauge(prometheus.GaugeOpts{Name: "outbox_relay_reconcile_phantom_records",
			Help: "Records the last complete periodic check found in Kafka with no outbox row."}),
		LastComplete: prometheus.NewGauge(prometheus.GaugeOpts{Name: "outbox_relay_reconcile_last_complete_timestamp_seconds",
			Help: "Unix time the last periodic check completed; 0 before the first."}),
		Failures: prometheus.NewCounter(prometheus.CounterOpts{Name: "outbox_relay_reconcile_failures_total",
			Help: "Periodic checks that ended in an error."}),
		Interval: prometheus.NewGauge(prometheus.GaugeOpts{Name: "outbox_relay_reconcile_interval_seconds",
			Help: "How often the periodic check runs (--reconcile-every); 0 when it is off."}),
	}
	if reg != nil {
		reg.MustRegister(m.MissingEvents, m.Phantoms, m.LastComplete, m.Failures, m.Interval)
	}
	return m
}
