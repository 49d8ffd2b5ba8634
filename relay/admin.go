package relay

import (
	"context"
	"errors"
	"math"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/replication"
)

// SlotReport is the /slot document: the server's view of the slot, as the
// slot watch last read it, beside the relay's own.
type SlotReport struct {
	Slot      *replication.SlotInfo `json:"slot"`
	SlotError string                `json:"slot_error,omitempty"`
	// SlotReadAt is when the slot was read, and SlotAgeSeconds how long
	// ago; both are absent before the first reading.
	SlotReadAt     *time.Time `json:"slot_read_at,omitempty"`
	SlotAgeSeconds *float64   `json:"slot_reading_age_seconds,omitempty"`
	// WALRate is the server's WAL rate over the last minute, in bytes per
	// second; absent until two readings a second apart.
	WALRate *float64 `json:"wal_rate_bytes_per_second,omitempty"`
	// TimeLeft is how long the slot would last if the relay confirmed
	// nothing more (outbox_relay_slot_time_left_seconds), and TimeLeftLimit
	// the server limit that gives it; both absent when no limit applies.
	TimeLeft      *float64 `json:"time_left_seconds,omitempty"`
	TimeLeftLimit string   `json:"time_left_limit,omitempty"`
	Relay         *Status  `json:"relay,omitempty"`
}

// slotReport builds /slot from the poller's cached reading: a request
// never opens a PostgreSQL connection, so scraping it cannot exhaust the
// server's connections or hang on a dead one.
func (r *Relay) slotReport(now time.Time) SlotReport {
	status := r.Status()
	reading := r.slot.lastReading()
	report := SlotReport{Relay: &status, Slot: reading.info, SlotError: reading.err}
	if reading.at.IsZero() {
		report.SlotError = "the slot has not been read yet; the relay reads it every few seconds"
		return report
	}
	at, age := reading.at, now.Sub(reading.at).Seconds()
	report.SlotReadAt, report.SlotAgeSeconds = &at, &age
	if g := reading.guard; g != nil {
		if g.RateOK {
			report.WALRate = &g.Rate
		}
		if !math.IsInf(g.Left, 1) {
			report.TimeLeft, report.TimeLeftLimit = &g.Left, g.Limit
		}
	}
	return report
}

// ReadSlot reads the slot's state from PostgreSQL on a short-lived
// connection, with a warning when the slot would not survive a failover
// (see replication.Admin.FailoverWarning). It works whether or not a relay
// is streaming, on a primary or a standby.
func ReadSlot(ctx context.Context, cfg replication.Config) (info *replication.SlotInfo, failoverWarning string, err error) {
	admin, err := replication.Connect(ctx, cfg)
	if err != nil {
		return nil, "", err
	}
	defer admin.Close(context.Background())
	info, ok, err := admin.Slot(ctx)
	if err != nil {
		return nil, "", err
	}
	failoverWarning, err = admin.FailoverWarning(ctx, info, ok)
	if err != nil {
		return nil, "", err
	}
	if !ok {
		if failoverWarning != "" {
			return nil, "", errors.New(failoverWarning)
		}
		return nil, "", &slotMissingError{slot: cfg.Slot}
	}
	return info, failoverWarning, nil
}

type slotMissingError struct{ slot string }

func (e *slotMissingError) Error() string {
	return "slot " + e.slot + " does not exist: run `outbox-relay migrate`"
}

// AdminHandler serves the read-only admin endpoint: /healthz, /readyz,
// /slot and /metrics.
func (r *Relay) AdminHandler(gatherer prometheus.Gatherer) http.Handler {
	return pipeline.AdminHandler(gatherer, pipeline.Admin{
		Ready: r.Ready, Path: "/slot",
		Document:  func() any { return r.slotReport(time.Now()) },
		Elsewhere: map[string]string{"/poll": "the WAL path (--source wal or messages) claims no rows: see /slot; /poll is poll mode's (--source poll)"},
	})
}
