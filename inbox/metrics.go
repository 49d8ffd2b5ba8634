package inbox

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics counts what an Inbox did. Register it with a Prometheus
// registry; Counts reads the same numbers without one.
type Metrics struct {
	applied, duplicates, staleVersions, gaps, handlerErrors, missingReports atomic.Int64
	unparsable, skipped                                                     atomic.Int64
	missing                                                                 atomic.Int64
	occurredToApplied                                                       prometheus.Histogram
	collectors                                                              []prometheus.Collector
}

// Counts is a snapshot of Metrics.
type Counts struct {
	Applied int64 // events whose handler ran and committed
	// Duplicates are re-delivered events skipped by their event_id;
	// StaleVersions are events skipped because their aggregate version was
	// already applied, or is parked under another event_id.
	Duplicates, StaleVersions int64
	VersionGaps               int64 // events that arrived before their predecessor
	HandlerErrors             int64 // handler calls that failed (each rolled back)
	MissingReports            int64 // predecessors reported missing past the limit
	MissingPredecessors       int64 // aggregates waiting past the limit at the last Overdue call
	Unparsable                int64 // records set aside because no event could be read from them
	SkippedVersions           int64 // versions an operator declared missing for good (SkipMissing)
}

// NewMetrics returns the collectors for one consumer; the consumer name is
// a constant label.
func NewMetrics(consumer string) *Metrics {
	m := &Metrics{}
	labels := prometheus.Labels{"consumer": consumer}
	counter := func(name, help string, v *atomic.Int64, extra prometheus.Labels) {
		l := prometheus.Labels{}
		for k, x := range labels {
			l[k] = x
		}
		for k, x := range extra {
			l[k] = x
		}
		m.collectors = append(m.collectors, prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: name, Help: help, ConstLabels: l,
		}, func() float64 { return float64(v.Load()) }))
	}
	counter("inbox_events_applied_total", "Events whose handler ran and committed with their processed-event record.", &m.applied, nil)
	counter("inbox_duplicates_skipped_total", "Events skipped without running the handler: a re-delivered event_id, or a version already applied.", &m.duplicates, prometheus.Labels{"reason": "event_id"})
	counter("inbox_duplicates_skipped_total", "Events skipped without running the handler: a re-delivered event_id, or a version already applied.", &m.staleVersions, prometheus.Labels{"reason": "version"})
	counter("inbox_version_gaps_total", "Events that arrived before their aggregate's previous version (held back or refused).", &m.gaps, nil)
	counter("inbox_handler_errors_total", "Handler calls that returned an error; each rolled back its record and effect.", &m.handlerErrors, nil)
	counter("inbox_missing_predecessor_reports_total", "Times an event waited on a predecessor longer than the limit.", &m.missingReports, nil)
	counter("inbox_unparsable_records_total", "Records no event could be read from, set aside in the unparsable table so their partition goes on.", &m.unparsable, nil)
	counter("inbox_versions_skipped_total", "Aggregate versions an operator declared missing for good (SkipMissing).", &m.skipped, nil)
	m.collectors = append(m.collectors, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "inbox_missing_predecessors", ConstLabels: labels,
		Help: "Aggregates whose next version has been missing longer than the limit, at the last check.",
	}, func() float64 { return float64(m.missing.Load()) }))
	m.occurredToApplied = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "inbox_occurred_to_applied_seconds", ConstLabels: labels, Buckets: latencyBuckets,
		Help: "From the event's occurred_at header (a CloudEvent's time) to its handler's commit, for events applied (records without either are not observed).",
	})
	m.collectors = append(m.collectors, m.occurredToApplied)
	return m
}

// latencyBuckets are the relay's latency buckets (sub-millisecond to
// minutes), so its commit-to-ack and this line up on one dashboard.
var latencyBuckets = []float64{.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30, 60, 300}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors {
		c.Collect(ch)
	}
}

// Counts returns the current values.
func (m *Metrics) Counts() Counts {
	return Counts{
		Applied: m.applied.Load(), Duplicates: m.duplicates.Load(), StaleVersions: m.staleVersions.Load(),
		VersionGaps: m.gaps.Load(), HandlerErrors: m.handlerErrors.Load(),
		MissingReports: m.missingReports.Load(), MissingPredecessors: m.missing.Load(),
		Unparsable: m.unparsable.Load(), SkippedVersions: m.skipped.Load(),
	}
}
