package relay

// Exactly-once delivery: each session's sink is a transactional producer
// whose Kafka transactions hold whole source transactions plus the progress
// record of the last of them. The producer is initialised, fencing any
// older one with the same transactional id, before the session reads the
// progress record, so no zombie can commit after the position is read.

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
)

// ValidateDelivery checks --delivery and, for exactly-once, the settings
// it needs.
func (c Config) ValidateDelivery() error {
	switch c.Delivery {
	case DeliveryAtLeastOnce, "": // the zero value is the safe default
		return nil
	case DeliveryExactlyOnce:
	default:
		return fmt.Errorf("--delivery %q: use %s or %s", c.Delivery, DeliveryAtLeastOnce, DeliveryExactlyOnce)
	}
	if c.TransactionInterval <= 0 || c.TransactionInterval > maxTransactionInterval {
		return fmt.Errorf("--transaction-interval %s: must be more than 0 and at most %s", c.TransactionInterval, maxTransactionInterval)
	}
	if c.Progress.Topic == "" {
		return errors.New("--delivery exactly-once needs --progress-topic: the progress record is written inside every Kafka transaction")
	}
	return nil
}

// DeliveryMode is the configured mode, the zero value read as the
// default: the one place that default is decided.
func (c Config) DeliveryMode() string {
	if c.Delivery == "" {
		return DeliveryAtLeastOnce
	}
	return c.Delivery
}

// exactlyOnce reports whether sessions publish through Kafka transactions.
func (c Config) exactlyOnce() bool { return c.DeliveryMode() == DeliveryExactlyOnce }

// transactionalID is the configured id, or the one derived from the slot
// and the cluster.
func (c Config) transactionalID(sys replication.System) string {
	if c.TransactionalID != "" {
		return c.TransactionalID
	}
	return TransactionalID(c.Replication.Slot, sys.ID)
}

// TransactionalID is the default transactional.id of a relay: the
// replication slot and the database's system identifier, the same pair that
// keys the progress record. Two relays on one slot of one cluster share it,
// so the newer fences the older; relays of different slots or clusters never
// fence each other.
func TransactionalID(slot, systemID string) string {
	return "outbox-relay:" + slot + "@" + systemID
}

// exactlyOnce is what exactly-once delivery keeps across sessions: the
// transactional id in use, what every session's producer did, and the
// events Kafka refused inside a transaction, kept so a re-streamed batch
// does not meet the same refusal for ever. In at-least-once mode it only
// names the mode in the status.
type exactlyOnce struct {
	cfg      Config
	log      zerolog.Logger
	metrics  *txnMetrics
	progress *progressKeeper // notes the record each committed transaction carried

	committed, aborted, split atomic.Uint64

	mu    sync.Mutex
	txnID string
}

func newExactlyOnce(cfg Config, log zerolog.Logger, metrics *txnMetrics, progress *progressKeeper) *exactlyOnce {
	metrics.mode(cfg.DeliveryMode())
	return &exactlyOnce{cfg: cfg, log: log, metrics: metrics, progress: progress}
}

// newSink initialises a transactional producer, which fences older ones
// with the same id.
func (e *exactlyOnce) newSink(batchLimit int, sys replication.System) (sink.Sink, error) {
	t := sink.Transactional{ID: e.cfg.transactionalID(sys), Interval: e.cfg.TransactionInterval,
		// A batch must end before the loop's in-flight limits fill: acks
		// wait for the commit, and a commit forced at the limit splits the
		// source transaction under way. Half the limits leaves the other
		// half to the transaction that crosses the batch's end.
		BatchEvents: max(1, e.cfg.inFlightEvents()/2),
		BatchBytes:  int(max(1, e.cfg.MaxInFlightBytes/2)),
	}
	e.mu.Lock()
	e.txnID = t.ID
	e.mu.Unlock()
	return e.cfg.Sinks.NewTransactional(batchLimit, t)
}

// txnProgress is the progress record each Kafka transaction carries for
// its last whole source transaction, under the key and timeline the
// session's start decided. The read loop hands the same one to the sink
// with every source transaction's end, and the sink encodes the value of
// the last one when it commits: it never changes, so sharing it is safe.
type txnProgress struct {
	topic        string
	key          []byte
	timeline     uint32
	relayVersion string
	// record is what the sink gets; nil when the session has no progress
	// key. withRecord makes it.
	record *sink.ProgressRecord
}

// withRecord returns p with its progress record made.
func (p txnProgress) withRecord() txnProgress {
	if p.key != nil {
		p.record = &sink.ProgressRecord{Topic: p.topic, Key: p.key, Encode: p.encode}
	}
	return p
}

// encode is the progress value for a source transaction ending at end.
func (p txnProgress) encode(end lsn.LSN, commitTime time.Time) []byte {
	rec := progress.Record{LSN: end, Timeline: p.timeline, CommitTime: commitTime, RelayVersion: p.relayVersion, Delivery: DeliveryExactlyOnce}
	return rec.Marshal()
}

// ended takes the sink's report of a Kafka transaction's end, on the
// read loop's goroutine, for the metrics and the status.
func (e *exactlyOnce) ended(rep sink.TxnReport, timeline uint32) {
	switch {
	case rep.Split:
		e.split.Add(1)
		e.metrics.SplitSourceTxns.Inc()
	case !rep.Committed:
		e.aborted.Add(1)
		e.metrics.Transactions.WithLabelValues("aborted").Inc()
	default:
		e.committed.Add(1)
		e.metrics.Transactions.WithLabelValues("committed").Inc()
		if rep.End != 0 { // zero: only part of a split source transaction, no progress record
			e.progress.written(progress.Record{LSN: rep.End, Timeline: timeline, CommitTime: rep.CommitTime})
		}
	}
}

// DeliveryStatus is the delivery part of the relay's status.
type DeliveryStatus struct {
	Mode            string `json:"mode"`
	TransactionalID string `json:"transactional_id,omitempty"`
	// Kafka transactions committed and aborted, and source transactions
	// too large for one Kafka transaction, committed in parts, since the
	// process started. The last committed progress is Progress.LSN.
	TxnsCommitted   uint64 `json:"kafka_transactions_committed"`
	TxnsAborted     uint64 `json:"kafka_transactions_aborted"`
	SplitSourceTxns uint64 `json:"split_source_transactions"`
}

// status is the delivery part of Status.
func (e *exactlyOnce) status() *DeliveryStatus {
	d := &DeliveryStatus{Mode: e.cfg.DeliveryMode()}
	if e.cfg.exactlyOnce() {
		e.mu.Lock()
		d.TransactionalID = e.txnID
		e.mu.Unlock()
		d.TxnsCommitted, d.TxnsAborted, d.SplitSourceTxns = e.committed.Load(), e.aborted.Load(), e.split.Load()
	}
	return d
}

// txnMetrics are the series of the delivery mode.
type txnMetrics struct {
	Mode            *prometheus.GaugeVec
	Transactions    *prometheus.CounterVec
	SplitSourceTxns prometheus.Counter
}

func newTxnMetrics(reg prometheus.Registerer) *txnMetrics {
	m := &txnMetrics{
		Mode: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_relay_delivery_mode", Help: "1 for the delivery mode the relay runs in: at-least-once or exactly-once."}, []string{"mode"}),
		Transactions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_kafka_transactions_total", Help: "Kafka transactions ended in exactly-once mode, by result: committed or aborted (an aborted one is re-streamed from the last committed progress)."}, []string{"result"}),
		SplitSourceTxns: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_split_source_transactions_total", Help: "Source transactions too large for one Kafka transaction, committed in parts: read_committed consumers saw their first part before the rest."}),
	}
	for _, result := range []string{"committed", "aborted"} {
		m.Transactions.WithLabelValues(result)
	}
	if reg != nil {
		reg.MustRegister(m.Mode, m.Transactions, m.SplitSourceTxns)
	}
	return m
}

func (m *txnMetrics) mode(mode string) {
	oneHot(m.Mode, []string{DeliveryAtLeastOnce, DeliveryExactlyOnce}, mode)
}

// oneHot sets the gauge of chosen to 1 and those of the other values to 0.
func oneHot(g *prometheus.GaugeVec, values []string, chosen string) {
	for _, each := range values {
		v := 0.0
		if each == chosen {
			v = 1
		}
		g.WithLabelValues(each).Set(v)
	}
}
