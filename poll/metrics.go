package poll

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/sink"
)

// Metrics are poll mode's Prometheus series: those every source shares,
// and poll mode's own, named outbox_relay_poll_*.
type Metrics struct {
	// Metrics are the series every source shares.
	*pipeline.Metrics

	// QuarantinedTotal counts the events this poller quarantined; the
	// shared Quarantined gauge is the quarantine table's count of events
	// waiting for a replay (see Poller.countQuarantined).
	QuarantinedTotal prometheus.Counter

	Pending       prometheus.Gauge
	OldestPending prometheus.Gauge
	Waiting       prometheus.Gauge
	Leased        prometheus.Gauge
	LeasesExpired prometheus.Counter
	RowsGone      prometheus.Counter
	Claims        *prometheus.CounterVec
	RowsClaimed   prometheus.Counter
	InsertToAck   prometheus.Histogram

	// The snapshot strategy's: how long ago its progress last moved, and
	// how long the oldest transaction that holds a transaction id has been
	// open (its rows, if any, are published once it commits; meanwhile it
	// holds back vacuum, and every batch looks its id up).
	SnapshotLag     prometheus.Gauge
	SnapshotOldest  prometheus.Gauge
	SnapshotWindows *prometheus.CounterVec
}

// NewMetrics registers the shared series and poll mode's own with reg;
// nil registers none.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	s := pipeline.NewSeries(reg)
	m := &Metrics{
		Metrics:          pipeline.NewMetrics(reg),
		QuarantinedTotal: s.Counter("outbox_relay_poll_quarantined_total", "Events this poller put in the quarantine table."),
		Pending:          s.Gauge("outbox_relay_poll_pending_rows", "Outbox rows not published yet, quarantined ones included."),
		OldestPending:    s.Gauge("outbox_relay_poll_oldest_pending_age_seconds", "Age of the oldest row not published yet; 0 when none."),
		Waiting:          s.Gauge("outbox_relay_poll_backing_off_rows", "Rows waiting for their next attempt after a failure."),
		Leased:           s.Gauge("outbox_relay_poll_leased_rows", "Rows claimed by a poller now, with a valid lease."),
		LeasesExpired:    s.Counter("outbox_relay_poll_leases_expired_total", "Rows claimed again after their lease expired unmarked; each may be a duplicate."),
		RowsGone:         s.Counter("outbox_relay_poll_rows_gone_total", "Pending rows whose outbox row was deleted before it was published."),
		Claims:           s.CounterVec("outbox_relay_poll_claims_total", "Claim statements run, by whether they found rows (rows, empty).", "result"),
		RowsClaimed:      s.Counter("outbox_relay_poll_rows_claimed_total", "Rows claimed."),
		InsertToAck:      s.Latency("outbox_relay_poll_insert_to_ack_seconds", "From the row's insert (a little before its commit) to Kafka's acknowledgement."),
		SnapshotLag:      s.Gauge("outbox_relay_poll_snapshot_lag_seconds", "Snapshot strategy: seconds since its progress row last moved; it moves at least every --poll-interval while the poller keeps up."),
		SnapshotOldest:   s.Gauge("outbox_relay_poll_snapshot_oldest_open_transaction_seconds", "Snapshot strategy: how long the oldest open transaction holding a transaction id (prepared ones included) has been open. Its rows are published once it commits, without holding back the rows of others."),
		SnapshotWindows:  s.CounterVec("outbox_relay_poll_snapshot_windows_total", "Snapshot strategy: snapshots read, by whether their window held rows (rows, empty).", "result"),
	}
	for _, result := range []string{"rows", "empty"} {
		m.SnapshotWindows.WithLabelValues(result)
	}
	for _, result := range []string{"rows", "empty"} {
		m.Claims.WithLabelValues(result)
	}
	return m
}

func (m *Metrics) observeClaim(rows int) {
	if rows == 0 {
		m.Claims.WithLabelValues("empty").Inc()
		return
	}
	m.Claims.WithLabelValues("rows").Inc()
	m.RowsClaimed.Add(float64(rows))
}

func (m *Metrics) observeAck(d sink.Delivery, insertedAt time.Time) {
	m.Acked(d.Topic, d.Bytes)
	if !insertedAt.IsZero() {
		m.InsertToAck.Observe(d.At.Sub(insertedAt).Seconds())
	}
}

func (m *Metrics) observeStats(s Stats, now time.Time) {
	m.Pending.Set(float64(s.Pending))
	m.Leased.Set(float64(s.Leased))
	m.Waiting.Set(float64(s.BackingOff))
	age := 0.0
	if s.OldestPending != nil {
		age = now.Sub(*s.OldestPending).Seconds()
	}
	m.OldestPending.Set(age)
}
