// Package pipeline runs a source: what the WAL path, the messages source
// and poll mode share around the sessions that read, publish and confirm
// events. It holds the restart loop that runs a source's sessions, the one
// status model (State, Status), the metrics every source exports with one
// meaning per name, the quarantine-write error, and the admin endpoint.
// A source adds its own series, its session and its JSON document.
package pipeline

import (
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/outbox-relay/outbox-relay/sink"
)

// Metrics are the series every source exports. Each name means the same
// for every source, so one dashboard and one set of alerts serve them all;
// a source registers its own series (slot, LSN, poll_*) beside these.
type Metrics struct {
	EventsPublished  *prometheus.CounterVec
	BytesPublished   *prometheus.CounterVec
	PublishErrors    *prometheus.CounterVec
	OrderBreaks      *prometheus.CounterVec
	Restarts         prometheus.Counter
	Quarantined      prometheus.Gauge
	RetentionDeleted prometheus.Counter
	RetentionRuns    prometheus.Counter
	State            *prometheus.GaugeVec
	// TopicPartitions and TopicPartitionsUsed are each event topic's
	// partition count and the count its keys are mapped by; they differ
	// once partitions were added and not yet adopted (docs/partitions.md).
	TopicPartitions     *prometheus.GaugeVec
	TopicPartitionsUsed *prometheus.GaugeVec
	// TopicPartitionsRecordedOverRecords counts the topics whose count
	// the relay recorded, as on a first start, while they already held
	// records: the registry was lost (docs/partitions.md).
	TopicPartitionsRecordedOverRecords *prometheus.CounterVec
	// KafkaThrottle sums the time the brokers made the relay's clients
	// wait (quotas).
	KafkaThrottle prometheus.Counter

	mu       sync.Mutex
	perTopic map[string]topicCounters
}

type topicCounters struct{ events, bytes prometheus.Counter }

// LatencyBuckets suit every latency histogram of every source:
// sub-millisecond on an idle system up to minutes behind a Kafka outage.
var LatencyBuckets = []float64{.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30, 60, 300}

// NewMetrics creates the shared series and registers them, with the Go and
// process collectors, on reg (nil: create them unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	s := NewSeries(reg)
	m := &Metrics{
		EventsPublished:                    s.CounterVec("outbox_relay_events_published_total", "Events acknowledged by Kafka, by topic.", "topic"),
		BytesPublished:                     s.CounterVec("outbox_relay_bytes_published_total", "Record bytes acknowledged by Kafka, by topic.", "topic"),
		PublishErrors:                      s.CounterVec("outbox_relay_publish_errors_total", "Records Kafka failed, one per failed attempt, by error class (retriable, producer, permanent).", "class"),
		OrderBreaks:                        s.CounterVec("outbox_relay_order_breaks_total", "Failed records that later records of their partition may have passed in Kafka, so that their re-delivery lands after them (per-aggregate order broken); by the partition's topic and number.", "topic", "partition"),
		Restarts:                           s.Counter("outbox_relay_stream_restarts_total", "Sessions restarted after a failure of PostgreSQL or Kafka (not the waits of a standby); each reads again what was not confirmed."),
		Quarantined:                        s.Gauge("outbox_relay_quarantined_events", "Events in the quarantine table waiting for a replay."),
		RetentionDeleted:                   s.Counter("outbox_relay_retention_rows_deleted_total", "Published outbox rows deleted by retention cleanup."),
		RetentionRuns:                      s.Counter("outbox_relay_retention_runs_total", "Retention cleanup passes completed."),
		State:                              s.GaugeVec("outbox_relay_state", "1 for the instance's current state (streaming or polling while it publishes; starting, connecting, waiting-for-slot, waiting-for-promotion, backing-off, draining, stopped, failed), 0 for the others.", "state"),
		TopicPartitions:                    s.GaugeVec("outbox_relay_topic_partitions", "Partitions of each event topic the relay published to, as the brokers' metadata last showed them (checked every 10s).", "topic"),
		TopicPartitionsUsed:                s.GaugeVec("outbox_relay_topic_partitions_used", "The partition count each event topic's keys are mapped by: the one the relay recorded for the topic, until an operator adopts another (outbox-relay partitions adopt). Below outbox_relay_topic_partitions after partitions were added: keys stay where they were, the new partitions get nothing.", "topic"),
		TopicPartitionsRecordedOverRecords: s.CounterVec("outbox_relay_topic_partitions_recorded_over_records_total", "Times the relay recorded an event topic's partition count, as on its first start, while the topic already held records: its registry row was lost (outbox_relay_partitions dropped, or restored without it), and the partitions the topic's keys were mapped by before are unknown to it. Any increase: check outbox-relay partitions show, and adopt the count the records were written with if the topic's count changed since.", "topic"),
		KafkaThrottle:                      s.Counter("outbox_relay_kafka_throttle_seconds_total", "Time the brokers asked the relay's Kafka clients to wait before their next request, because a quota (producer_byte_rate, request_percentage) was exceeded; its rate is the share of time publishing was held back."),
		perTopic:                           make(map[string]topicCounters),
	}
	if reg != nil {
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	m.SetState(StateStarting)
	// Every error class exists from the start, at 0, so rate() and
	// dashboards see a series before the first error.
	for _, class := range sink.Classes() {
		m.PublishErrors.WithLabelValues(string(class))
	}
	return m
}

// SetTopicPartitions sets a topic's partition gauges; used 0 (not known)
// leaves the used gauge as it was.
func (m *Metrics) SetTopicPartitions(topic string, actual, used int32) {
	m.TopicPartitions.WithLabelValues(topic).Set(float64(actual))
	if used > 0 {
		m.TopicPartitionsUsed.WithLabelValues(topic).Set(float64(used))
	}
}

// SetState makes state the one outbox_relay_state series at 1. Every
// state of every source is exported, so a query never misses a series.
func (m *Metrics) SetState(state State) {
	for _, s := range States {
		v := 0.0
		if s == state {
			v = 1
		}
		m.State.WithLabelValues(string(s)).Set(v)
	}
}

// Acked counts a record of bytes the sink acknowledged on topic. The
// per-topic counters are kept, so an ack does not look up its label
// values again.
func (m *Metrics) Acked(topic string, bytes int) {
	m.mu.Lock()
	c, ok := m.perTopic[topic]
	if !ok {
		c = topicCounters{m.EventsPublished.WithLabelValues(topic), m.BytesPublished.WithLabelValues(topic)}
		m.perTopic[topic] = c
	}
	m.mu.Unlock()
	c.events.Inc()
	c.bytes.Add(float64(bytes))
}

// Failed counts a record the sink failed, by what it needs.
func (m *Metrics) Failed(class sink.Class) {
	m.PublishErrors.WithLabelValues(string(class)).Inc()
}

// OrderBroke counts a failed record that later ones of its partition may
// have passed.
func (m *Metrics) OrderBroke(topic string, partition int32) {
	m.OrderBreaks.WithLabelValues(topic, strconv.Itoa(int(partition))).Inc()
}
