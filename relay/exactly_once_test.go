package relay

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
)

func TestValidateDelivery(t *testing.T) {
	for _, tc := range []struct {
		delivery string
		interval time.Duration
		topic    string
		wantFlag string // "" when valid
	}{
		{DeliveryAtLeastOnce, 0, "", ""}, // the interval and topic matter only to exactly-once
		{DeliveryExactlyOnce, 100 * time.Millisecond, "p", ""},
		{"exactly-twice", 100 * time.Millisecond, "p", "--delivery"},
		{"", 0, "", ""}, // the zero value is at-least-once
		{DeliveryExactlyOnce, 0, "p", "--transaction-interval"},
		{DeliveryExactlyOnce, 11 * time.Second, "p", "--transaction-interval"},
		{DeliveryExactlyOnce, 100 * time.Millisecond, "", "--progress-topic"},
	} {
		c := Config{Delivery: tc.delivery, TransactionInterval: tc.interval, Progress: ProgressOptions{Topic: tc.topic}}
		err := c.ValidateDelivery()
		if tc.wantFlag == "" && err != nil || tc.wantFlag != "" && (err == nil || !strings.Contains(err.Error(), tc.wantFlag)) {
			t.Errorf("%+v: %v, want an error naming %q", tc, err, tc.wantFlag)
		}
	}
}

func TestTransactionalIDDerivedOrOverridden(t *testing.T) {
	c := Config{Replication: replication.Config{Slot: "s1"}}
	sys := replication.System{ID: "7441203541094113303"}
	if got := c.transactionalID(sys); got != "outbox-relay:s1@7441203541094113303" {
		t.Errorf("derived id %q", got)
	}
	c.TransactionalID = "mine"
	if got := c.transactionalID(sys); got != "mine" {
		t.Errorf("overridden id %q", got)
	}
}

// What the transactional producer reports shows in /slot and the metrics,
// adding up over the sinks of every session; a commit of a split part
// moves no progress.
func TestDeliveryStatusAndMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	cfg := DefaultConfig()
	cfg.Delivery = DeliveryExactlyOnce
	r := New(cfg, zerolog.Nop(), m, Hooks{})
	r.progress.report.Topic = "outbox-relay.progress"
	r.progress.timeline = 1
	r.delivery.txnID = "outbox-relay:s@1"

	// Reports of two sessions' sinks, as their loops take them.
	commitTime := time.Date(2026, 12, 1, 4, 0, 0, 0, time.UTC)
	r.delivery.ended(sink.TxnReport{Committed: true, End: lsn.LSN(0x100), CommitTime: commitTime}, 1)
	r.delivery.ended(sink.TxnReport{}, 1)
	r.delivery.ended(sink.TxnReport{Split: true}, 1)
	r.delivery.ended(sink.TxnReport{Committed: true}, 1) // the first part of a split transaction

	d := r.Status().Delivery
	if d.Mode != DeliveryExactlyOnce || d.TransactionalID != "outbox-relay:s@1" ||
		d.TxnsCommitted != 2 || d.TxnsAborted != 1 || d.SplitSourceTxns != 1 {
		t.Fatalf("delivery status %+v", d)
	}
	if p := r.Status().Progress; p == nil || p.LSN != lsn.LSN(0x100).String() || p.CommitTime == nil || !p.CommitTime.Equal(commitTime) {
		t.Fatalf("progress status %+v, want the last committed progress %s", p, lsn.LSN(0x100))
	}
	for _, c := range []struct {
		name      string
		got, want float64
	}{
		{"committed", metricValue(t, m.txn.Transactions.WithLabelValues("committed")), 2},
		{"aborted", metricValue(t, m.txn.Transactions.WithLabelValues("aborted")), 1},
		{"split", metricValue(t, m.txn.SplitSourceTxns), 1},
		{"mode exactly-once", metricValue(t, m.txn.Mode.WithLabelValues(DeliveryExactlyOnce)), 1},
		{"mode at-least-once", metricValue(t, m.txn.Mode.WithLabelValues(DeliveryAtLeastOnce)), 0},
		{"progress lsn", metricValue(t, m.progress.LSN), 0x100},
	} {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}

	alo := New(DefaultConfig(), zerolog.Nop(), nil, Hooks{}).Status().Delivery
	if alo.Mode != DeliveryAtLeastOnce || alo.TransactionalID != "" || alo.TxnsCommitted != 0 {
		t.Fatalf("at-least-once delivery status %+v", alo)
	}
}

// metricValue reads a counter's or gauge's value.
func metricValue(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var out dto.Metric
	if err := m.Write(&out); err != nil {
		t.Fatal(err)
	}
	if c := out.GetCounter(); c != nil {
		return c.GetValue()
	}
	return out.GetGauge().GetValue()
}

// Exactly-once acks wait for the commit, so its window must hold whole
// Kafka transactions; at-least-once keeps the small window that bounds a
// crash's duplicates. An operator's own bound wins in both modes.
func TestInFlightEventsDefaultByDeliveryMode(t *testing.T) {
	cfg := DefaultConfig()
	if got := cfg.inFlightEvents(); got != defaultInFlightEvents {
		t.Errorf("at-least-once default %d, want %d", got, defaultInFlightEvents)
	}
	cfg.Delivery = DeliveryExactlyOnce
	if got := cfg.inFlightEvents(); got != defaultInFlightEventsExactlyOnce {
		t.Errorf("exactly-once default %d, want %d", got, defaultInFlightEventsExactlyOnce)
	}
	cfg.MaxInFlightEvents = 700
	if got := cfg.inFlightEvents(); got != 700 {
		t.Errorf("configured bound read as %d, want 700", got)
	}
	cfg.MaxInFlightEvents = -1
	cfg.Replication.DSN = "postgres://relay@127.0.0.1/app"
	kafka := publisher.DefaultConfig()
	kafka.Brokers = []string{"127.0.0.1:9092"}
	cfg.Sinks = publisher.NewKafka(kafka, zerolog.Nop())
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "--max-in-flight-events") {
		t.Errorf("a negative bound validated as %v", err)
	}
}
