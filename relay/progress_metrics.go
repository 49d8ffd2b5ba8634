package relay

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/progress"
)

// progressMetrics are the series about the progress kept in Kafka.
type progressMetrics struct {
	LSN            prometheus.Gauge
	WrittenAt      prometheus.Gauge
	StartSource    *prometheus.GaugeVec
	OrphanedRanges prometheus.Counter
	OrphanedBytes  prometheus.Counter
	SlotGaps       prometheus.Counter

	writtenNs atomic.Int64 // last write, for the age gauge
}

func newProgressMetrics(reg prometheus.Registerer) *progressMetrics {
	m := &progressMetrics{
		LSN: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_progress_lsn", Help: "WAL position last stored in the progress topic, as a number: Kafka holds every event before it."}),
		WrittenAt: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_progress_written_timestamp_seconds", Help: "Unix time the progress record was last written to Kafka."}),
		StartSource: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_relay_start_source", Help: "1 for where the last stream session started: the slot's confirmed position or the progress record."}, []string{"source"}),
		OrphanedRanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_timeline_orphaned_ranges_total", Help: "Starts that found the progress record past the point where the server's timeline branched off: events in that WAL range may be in Kafka without existing in the database."}),
		OrphanedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_timeline_orphaned_wal_bytes_total", Help: "Size of those WAL ranges, in bytes."}),
		SlotGaps: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_slot_gaps_total", Help: "Starts on a slot created after the position the progress record holds: events committed in between may be missing from Kafka; the relay's error log names the window and the reconcile command."}),
	}
	ageStart := time.Now()
	age := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "outbox_relay_progress_age_seconds", Help: "Seconds since the progress record was last written to Kafka (since the relay started, until the first write)."},
		func() float64 {
			// Read at scrape time so the age grows while writes fail.
			if ns := m.writtenNs.Load(); ns != 0 {
				return time.Since(time.Unix(0, ns)).Seconds()
			}
			return time.Since(ageStart).Seconds()
		})
	for _, s := range []string{StartFromSlot, StartFromProgress} {
		m.StartSource.WithLabelValues(s)
	}
	if reg != nil {
		reg.MustRegister(m.LSN, m.WrittenAt, m.StartSource, m.OrphanedRanges, m.OrphanedBytes, m.SlotGaps, age)
	}
	return m
}

func (m *progressMetrics) written(rec progress.Record, at time.Time) {
	m.LSN.Set(float64(rec.LSN))
	m.WrittenAt.Set(float64(at.UnixNano()) / 1e9)
	m.writtenNs.Store(at.UnixNano())
}

func (m *progressMetrics) started(source string) {
	oneHot(m.StartSource, []string{StartFromSlot, StartFromProgress}, source)
}

func (m *progressMetrics) orphaned(from, to lsn.LSN) {
	m.OrphanedRanges.Inc()
	m.OrphanedBytes.Add(float64(to - from))
}
