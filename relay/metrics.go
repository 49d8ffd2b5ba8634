package relay

import (
	"github.com/prometheus/client_golang/prometheus"
	"math"

	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
)

// Metrics are the relay's Prometheus series. Each Relay owns its own set,
// registered on the registry it is given. The relay only writes them: what
// the relay reports about itself (Status) it keeps on its own.
type Metrics struct {
	// Metrics are the series every source shares.
	*pipeline.Metrics

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
	// MessagesSkipped counts the logical decoding messages the messages
	// source read and did not publish, by reason.
	MessagesSkipped    *prometheus.CounterVec
	RetentionFailures  prometheus.Counter
	RetentionWatermark prometheus.Gauge
	SlotWALStatus      *prometheus.GaugeVec
	SlotTimeLeft       prometheus.Gauge
	// What --on-slot-lost recover did: recoveries by result, the events
	// they republished, and how long the last one took.
	SlotRecoveries          *prometheus.CounterVec
	SlotRecoveryRepublished prometheus.Counter
	SlotRecoverySeconds     prometheus.Gauge
	// SlotsMade counts the slots this relay made, by what the table held
	// before them (the existing_rows of the slot's record).
	SlotsMade *prometheus.CounterVec

	progress *progressMetrics
	txn      *txnMetrics
}

// NewMetrics creates the shared series and the WAL path's own, and
// registers them on reg (nil: create them unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	s := pipeline.NewSeries(reg)
	m := &Metrics{
		Metrics:           pipeline.NewMetrics(reg),
		Retries:           s.Counter("outbox_relay_producer_retries_total", "Producer retries after retriable errors (each is one backoff)."),
		InFlightEvents:    s.Gauge("outbox_relay_in_flight_events", "Events sent to Kafka and not yet acknowledged."),
		ReceivedLSN:       s.Gauge("outbox_relay_received_lsn", "Highest WAL position read from the slot, as a number."),
		ConfirmedLSN:      s.Gauge("outbox_relay_confirmed_lsn", "WAL position confirmed to PostgreSQL, as a number."),
		SlotRetainedWAL:   s.Gauge("outbox_relay_slot_retained_wal_bytes", "WAL the slot holds: current WAL LSN minus restart_lsn."),
		SlotLag:           s.Gauge("outbox_relay_slot_lag_bytes", "Current WAL LSN minus the slot's confirmed_flush_lsn."),
		SlotActive:        s.Gauge("outbox_relay_slot_active", "1 when a process is streaming from the slot."),
		OldestUnpublished: s.Gauge("outbox_relay_oldest_unpublished_event_age_seconds", "Age of the oldest event not yet acknowledged: of those in flight while the relay reads the stream; while it does not (waiting for Kafka, restarting) and the slot is behind the server's WAL, the time since the slot last confirmed everything committed before it (an upper bound)."),
		SlotReadingAge:    s.Gauge("outbox_relay_slot_reading_age_seconds", "Time since the slot's state was last read from PostgreSQL; the slot gauges keep the values of that reading."),
		KafkaStall:        s.Gauge("outbox_relay_kafka_stall_seconds", "How long the events in flight have waited with no acknowledgement from Kafka; 0 when none wait."),

		MessagesSkipped:    s.CounterVec("outbox_relay_messages_skipped_total", "Logical decoding messages read and not published (--source messages): non-transactional ones, and those of another prefix.", "reason"),
		RetentionFailures:  s.Counter("outbox_relay_retention_failures_total", "Retention cleanup passes that failed; each is retried at the next interval."),
		RetentionWatermark: s.Gauge("outbox_relay_retention_cutoff_timestamp_seconds", "Rows created before this Unix time may be deleted by retention cleanup."),
		SlotWALStatus:      s.GaugeVec("outbox_relay_slot_wal_status", "1 for the slot's wal_status (reserved, extended, unreserved, lost), 0 for the others.", "wal_status"),
		SlotTimeLeft:       s.Gauge("outbox_relay_slot_time_left_seconds", "Seconds before PostgreSQL would invalidate the slot if the relay confirmed nothing more from now: safe_wal_size over the server's WAL rate of the last minute (max_slot_wal_keep_size) or, while nothing streams from the slot, what is left of idle_replication_slot_timeout; 0 once invalidated, +Inf when neither limit applies or the server writes no WAL."),
	}
	m.SlotTimeLeft.Set(math.Inf(1))
	m.CommitToAck = s.Latency("outbox_relay_commit_to_ack_seconds", "From the transaction's commit time to Kafka's acknowledgement.")
	m.CommitToReceive = s.Latency("outbox_relay_commit_to_receive_seconds", "From the transaction's commit time to the relay reading its first outbox row (PostgreSQL's share of commit_to_ack).")
	m.progress = newProgressMetrics(reg)
	m.txn = newTxnMetrics(reg)
	m.SlotRecoveries = s.CounterVec("outbox_relay_slot_recoveries_total", "Recoveries of a lost replication slot from the outbox table (--on-slot-lost recover), by result: recovered, refused (the table cannot cover the gap; the relay stops) or failed (tried again at the next session).", "result")
	m.SlotRecoveryRepublished = s.Counter("outbox_relay_slot_recovery_republished_events_total", "Events that recoveries of a lost slot republished from the outbox table, as Kafka lacked them.")
	m.SlotRecoverySeconds = s.Gauge("outbox_relay_slot_recovery_duration_seconds", "How long the last recovery of a lost slot took, from finding the slot lost to the new slot ready to stream (0 until one ran).")
	m.SlotsMade = s.CounterVec("outbox_relay_slots_created_total", "Replication slots the relay made, by what became of the rows the outbox table held before each: none (the table was empty), unchecked (the role may not read the table), published (--existing-rows published or --recreate-lost-slot: not published by the slot, and any Kafka lacks are lost), pending (--existing-rows pending republished those Kafka lacked) or recovered (--on-slot-lost recover republished the lost slot's gap).", "existing_rows")
	m.setWALStatus("")
	// The reasons and results exist from the start, at 0, as the error
	// classes do.
	for _, reason := range []string{skipOtherPrefix, skipNonTransactional} {
		m.MessagesSkipped.WithLabelValues(reason)
	}
	for _, result := range []string{recoveryDone, recoveryRefused, recoveryFailed} {
		m.SlotRecoveries.WithLabelValues(result)
	}
	for _, existing := range []string{replication.ExistingNone, replication.ExistingUnchecked, replication.ExistingPublished, replication.ExistingPending, replication.ExistingRecovered} {
		m.SlotsMade.WithLabelValues(existing)
	}
	return m
}

// The reasons of outbox_relay_messages_skipped_total.
const (
	skipOtherPrefix      = "other_prefix"
	skipNonTransactional = "non_transactional"
)

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

func (m *Metrics) acked(d sink.Delivery) {
	m.Acked(d.Topic, d.Bytes)
	if !d.CommitTime.IsZero() {
		m.CommitToAck.Observe(d.At.Sub(d.CommitTime).Seconds())
	}
}
