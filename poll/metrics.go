package poll

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/outbox-relay/outbox-relay/publisher"
)

// Metrics are poll mode's Prometheus series. Those that mean what they
// mean in WAL mode keep its names (events and bytes published, publish
// errors by class, quarantined events, order breaks, restarts, retention,
// state); the rest are named outbox_relay_poll_*.
type Metrics struct {
	EventsPublished  *prometheus.CounterVec
	BytesPublished   *prometheus.CounterVec
	PublishErrors    *prometheus.CounterVec
	OrderBreaks      *prometheus.CounterVec
	Restarts         prometheus.Counter
	Quarantined      prometheus.Counter
	RetentionDeleted prometheus.Counter
	RetentionRuns    prometheus.Counter
	State            *prometheus.GaugeVec

	Pending         prometheus.Gauge
	OldestPending   prometheus.Gauge
	Waiting         prometheus.Gauge
	Leased          prometheus.Gauge
	LeasesExpired   prometheus.Counter
	RowsGone        prometheus.Counter
	Claims          *prometheus.CounterVec
	RowsClaimed     prometheus.Counter
	InsertToAck     prometheus.Histogram
	QuarantineGauge prometheus.Gauge
}

// latencyBuckets span a quick ack (1 ms) to a long outage (about 9 min).
var latencyBuckets = prometheus.ExponentialBuckets(0.001, 2, 20)

// NewMetrics registers poll mode's metrics with reg; nil registers none.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		EventsPublished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_events_published_total", Help: "Events acknowledged by Kafka, by topic."}, []string{"topic"}),
		BytesPublished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_bytes_published_total", Help: "Record bytes acknowledged by Kafka, by topic."}, []string{"topic"}),
		PublishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_publish_errors_total", Help: "Failed attempts to publish an event, by error class (retriable, producer, permanent)."}, []string{"class"}),
		OrderBreaks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_order_breaks_total", Help: "Records Kafka acknowledged after an earlier record of their aggregate failed in the same batch; each is published again after it."}, []string{"topic", "partition"}),
		Restarts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_stream_restarts_total", Help: "Sessions restarted after a failure of PostgreSQL or Kafka."}),
		Quarantined: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_poll_quarantined_total", Help: "Events this poller put in the quarantine table."}),
		QuarantineGauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_quarantined_events", Help: "Events in the quarantine table waiting for a replay."}),
		RetentionDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_retention_rows_deleted_total", Help: "Published outbox rows deleted by retention cleanup."}),
		RetentionRuns: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_retention_runs_total", Help: "Retention cleanup passes completed."}),
		State: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_relay_state", Help: "1 for the relay's current state (polling, backing-off, ...), 0 for the others."}, []string{"state"}),
		Pending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_poll_pending_rows", Help: "Outbox rows not published yet, quarantined ones included."}),
		OldestPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_poll_oldest_pending_age_seconds", Help: "Age of the oldest row not published yet; 0 when none."}),
		Waiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_poll_backing_off_rows", Help: "Rows waiting for their next attempt after a failure."}),
		Leased: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_poll_leased_rows", Help: "Rows claimed by a poller now, with a valid lease."}),
		LeasesExpired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_poll_leases_expired_total", Help: "Rows claimed again after their lease expired unmarked; each may be a duplicate."}),
		RowsGone: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_poll_rows_gone_total", Help: "Pending rows whose outbox row was deleted before it was published."}),
		Claims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_poll_claims_total", Help: "Claim statements run, by whether they found rows (rows, empty)."}, []string{"result"}),
		RowsClaimed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_poll_rows_claimed_total", Help: "Rows claimed."}),
		InsertToAck: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "outbox_relay_poll_insert_to_ack_seconds", Help: "From the row's insert (a little before its commit) to Kafka's acknowledgement.",
			Buckets: latencyBuckets}),
	}
	if reg != nil {
		reg.MustRegister(m.EventsPublished, m.BytesPublished, m.PublishErrors, m.OrderBreaks, m.Restarts, m.Quarantined,
			m.QuarantineGauge, m.RetentionDeleted, m.RetentionRuns, m.State, m.Pending, m.OldestPending, m.Waiting, m.Leased,
			m.LeasesExpired, m.RowsGone, m.Claims, m.RowsClaimed, m.InsertToAck,
			collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	for _, class := range []publisher.Class{publisher.ClassRetriable, publisher.ClassProducer, publisher.ClassPermanent} {
		m.PublishErrors.WithLabelValues(string(class))
	}
	for _, result := range []string{"rows", "empty"} {
		m.Claims.WithLabelValues(result)
	}
	return m
}

var states = []string{StateStarting, StatePolling, StateBackingOff, StateStopped, StateFailed}

func (m *Metrics) setState(state string) {
	for _, s := range states {
		v := 0.0
		if s == state {
			v = 1
		}
		m.State.WithLabelValues(s).Set(v)
	}
}

func (m *Metrics) observeClaim(rows int) {
	if rows == 0 {
		m.Claims.WithLabelValues("empty").Inc()
		return
	}
	m.Claims.WithLabelValues("rows").Inc()
	m.RowsClaimed.Add(float64(rows))
}

func (m *Metrics) observeAck(d publisher.Delivery, insertedAt time.Time) {
	m.EventsPublished.WithLabelValues(d.Topic).Inc()
	m.BytesPublished.WithLabelValues(d.Topic).Add(float64(d.Bytes))
	if !insertedAt.IsZero() {
		m.InsertToAck.Observe(d.At.Sub(insertedAt).Seconds())
	}
}

func (m *Metrics) observeStats(s Stats, now time.Time) {
	m.Pending.Set(float64(s.Pending))
	m.QuarantineGauge.Set(float64(s.Quarantined))
	m.Leased.Set(float64(s.Leased))
	m.Waiting.Set(float64(s.BackingOff))
	age := 0.0
	if s.OldestPending != nil {
		age = now.Sub(*s.OldestPending).Seconds()
	}
	m.OldestPending.Set(age)
}

// partitionLabel is a partition as a label value.
func partitionLabel(p int32) string { return strconv.Itoa(int(p)) }
