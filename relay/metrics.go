package relay

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Metrics are the relay's Prometheus series. Each Relay owns its own set,
// registered on the registry it is given. The relay only writes them: what
// the relay reports about itself (Status) it keeps on its own.
type Metrics struct {
	EventsPublished   *prometheus.CounterVec
	BytesPublished    *prometheus.CounterVec
	PublishErrors     *prometheus.CounterVec
	Restarts          prometheus.Counter
	Retries           prometheus.Counter
	InFlightEvents    prometheus.Gauge
	ReceivedLSN       prometheus.Gauge
	ConfirmedLSN      prometheus.Gauge
	SlotRetainedWAL   prometheus.Gauge
	SlotLag           prometheus.Gauge
	SlotActive        prometheus.Gauge
	SlotReadingAge    prometheus.Gauge
	OldestUnpublished prometheus.Gauge
	KafkaStall        prometheus.Gauge
	// CommitToAck observes commit-to-ack latency in seconds. It is an
	// Observer so a benchmark can record exact values instead.
	CommitToAck prometheus.Observer
	// CommitToReceive observes, per transaction, the time from its commit
	// to the relay reading its first outbox row: the database's share of
	// CommitToAck (WAL flush, the walsender's decoding, the socket).
	CommitToReceive prometheus.Observer
	Quarantined     prometheus.Gauge
	OrderBreaks     *prometheus.CounterVec
	// MessagesSkipped counts the logical decoding messages the messages
	// source read and did not publish, by reason.
	MessagesSkipped    *prometheus.CounterVec
	RetentionDeleted   prometheus.Counter
	RetentionRuns      prometheus.Counter
	RetentionFailures  prometheus.Counter
	RetentionWatermark prometheus.Gauge
	State              *prometheus.GaugeVec
	SlotWALStatus      *prometheus.GaugeVec

	mu       sync.Mutex
	perTopic map[string]topicCounters

	progress *progressMetrics
	txn      *txnMetrics
}

type topicCounters struct{ events, bytes prometheus.Counter }

// NewMetrics creates the series and registers them, with the Go and process
// collectors, on reg (nil: create them unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		EventsPublished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_events_published_total", Help: "Events acknowledged by Kafka, by topic."}, []string{"topic"}),
		BytesPublished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_bytes_published_total", Help: "Record bytes acknowledged by Kafka, by topic."}, []string{"topic"}),
		PublishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_publish_errors_total", Help: "Records Kafka failed, by error class (retriable, producer, permanent)."}, []string{"class"}),
		Restarts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_stream_restarts_total", Help: "Stream sessions restarted after a failure; each re-streams from the slot."}),
		Retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_producer_retries_total", Help: "Producer retries after retriable errors (each is one backoff)."}),
		InFlightEvents: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_in_flight_events", Help: "Events sent to Kafka and not yet acknowledged."}),
		ReceivedLSN: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_received_lsn", Help: "Highest WAL position read from the slot, as a number."}),
		ConfirmedLSN: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_confirmed_lsn", Help: "WAL position confirmed to PostgreSQL, as a number."}),
		SlotRetainedWAL: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_slot_retained_wal_bytes", Help: "WAL the slot holds: current WAL LSN minus restart_lsn."}),
		SlotLag: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_slot_lag_bytes", Help: "Current WAL LSN minus the slot's confirmed_flush_lsn."}),
		SlotActive: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_slot_active", Help: "1 when a process is streaming from the slot."}),
		OldestUnpublished: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_oldest_unpublished_event_age_seconds", Help: "Age of the oldest event not yet acknowledged: of those in flight while the relay reads the stream; while it does not (waiting for Kafka, restarting) and the slot is behind the server's WAL, the time since the slot last confirmed everything committed before it (an upper bound)."}),
		SlotReadingAge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_slot_reading_age_seconds", Help: "Time since the slot's state was last read from PostgreSQL; the slot gauges keep the values of that reading."}),
		KafkaStall: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_kafka_stall_seconds", Help: "How long the events in flight have waited with no acknowledgement from Kafka; 0 when none wait."}),

		Quarantined: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_quarantined_events", Help: "Events in the quarantine table waiting for a replay."}),
		OrderBreaks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_order_breaks_total", Help: "Times a producer failure may have let later records of a partition land before re-delivered earlier ones."}, []string{"topic", "partition"}),
		MessagesSkipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_messages_skipped_total", Help: "Logical decoding messages read and not published (--source messages): non-transactional ones, and those of another prefix."}, []string{"reason"}),
		RetentionDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_retention_rows_deleted_total", Help: "Published outbox rows deleted by retention cleanup."}),
		RetentionRuns: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_retention_runs_total", Help: "Retention cleanup passes completed."}),
		RetentionFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_retention_failures_total", Help: "Retention cleanup passes that failed; each is retried at the next interval."}),
		RetentionWatermark: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_retention_cutoff_timestamp_seconds", Help: "Rows created before this Unix time may be deleted by retention cleanup."}),
		State: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_relay_state", Help: "1 for the relay's current state (streaming, waiting-for-slot, backing-off, ...), 0 for the others."}, []string{"state"}),
		SlotWALStatus: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_relay_slot_wal_status", Help: "1 for the slot's wal_status (reserved, extended, unreserved, lost), 0 for the others."}, []string{"wal_status"}),
		perTopic: make(map[string]topicCounters),
	}
	commitToAck := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "outbox_relay_commit_to_ack_seconds", Help: "From the transaction's commit time to Kafka's acknowledgement.",
		Buckets: latencyBuckets})
	m.CommitToAck = commitToAck
	commitToReceive := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "outbox_relay_commit_to_receive_seconds", Help: "From the transaction's commit time to the relay reading its first outbox row (PostgreSQL's share of commit_to_ack).",
		Buckets: latencyBuckets})
	m.CommitToReceive = commitToReceive
	if reg != nil {
		reg.MustRegister(m.EventsPublished, m.BytesPublished, m.PublishErrors, m.Restarts, m.Retries, m.InFlightEvents,
			m.ReceivedLSN, m.ConfirmedLSN, m.SlotRetainedWAL, m.SlotLag, m.SlotActive, m.SlotReadingAge, m.OldestUnpublished, m.KafkaStall,
			commitToAck, commitToReceive, m.Quarantined, m.OrderBreaks, m.MessagesSkipped, m.RetentionDeleted, m.RetentionRuns, m.RetentionFailures, m.RetentionWatermark,
			collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		reg.MustRegister(m.State, m.SlotWALStatus)
	}
	m.progress = newProgressMetrics(reg)
	m.txn = newTxnMetrics(reg)
	m.setState(StateStarting)
	m.setWALStatus("")
	// Every error class exists from the start, at 0, so rate() and
	// dashboards see a series before the first error.
	for _, class := range []publisher.Class{publisher.ClassRetriable, publisher.ClassProducer, publisher.ClassPermanent} {
		m.PublishErrors.WithLabelValues(string(class))
	}
	for _, reason := range skipReasons {
		m.MessagesSkipped.WithLabelValues(reason)
	}
	return m
}

// skipReasons are outbox_relay_messages_skipped_total's reason labels.
var skipReasons = map[replication.Skip]string{
	replication.SkipNonTransactional: "non_transactional",
	replication.SkipOtherPrefix:      "other_prefix",
}

// latencyBuckets suit both latency histograms: sub-millisecond on an idle
// system up to minutes behind a Kafka outage.
var latencyBuckets = []float64{.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30, 60, 300}

// states are the values of outbox_relay_state's label, all exported so a
// query never misses a series.
var states = []State{StateStarting, StateConnecting, StateStreaming, StateWaitingForSlot,
	StateWaitingForPromotion, StateBackingOff, StateDraining, StateStopped, StateFailed}

// setState makes state the one outbox_relay_state series at 1.
func (m *Metrics) setState(state State) {
	for _, s := range states {
		v := 0.0
		if s == state {
			v = 1
		}
		m.State.WithLabelValues(string(s)).Set(v)
	}
}

// walStatuses are the values pg_replication_slots.wal_status takes.
var walStatuses = []string{"reserved", "extended", "unreserved", "lost"}

// setWALStatus makes status the one outbox_relay_slot_wal_status series at
// 1; "" (unknown) sets them all to 0.
func (m *Metrics) setWALStatus(status string) {
	for _, s := range walStatuses {
		v := 0.0
		if s == status {
			v = 1
		}
		m.SlotWALStatus.WithLabelValues(s).Set(v)
	}
}

func (m *Metrics) acked(d publisher.Delivery) {
	now := d.At
	m.mu.Lock()
	c, ok := m.perTopic[d.Topic]
	if !ok {
		c = topicCounters{m.EventsPublished.WithLabelValues(d.Topic), m.BytesPublished.WithLabelValues(d.Topic)}
		m.perTopic[d.Topic] = c
	}
	m.mu.Unlock()
	c.events.Inc()
	c.bytes.Add(float64(d.Bytes))
	if !d.CommitTime.IsZero() {
		m.CommitToAck.Observe(now.Sub(d.CommitTime).Seconds())
	}
}

func (m *Metrics) failed(err *publisher.Error) {
	m.PublishErrors.WithLabelValues(string(err.Class)).Inc()
}
