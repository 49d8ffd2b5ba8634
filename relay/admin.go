package relay

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outbox-relay/outbox-relay/replication"
)

// SlotReport is the /slot document: the server's view of the slot, as the
// slot poller last read it, beside the relay's own.
type SlotReport struct {
	Slot      *replication.SlotInfo `json:"slot"`
	SlotError string                `json:"slot_error,omitempty"`
	// SlotReadAt is when the slot was read, and SlotAgeSeconds how long
	// ago; both are absent before the first reading.
	SlotReadAt     *time.Time `json:"slot_read_at,omitempty"`
	SlotAgeSeconds *float64   `json:"slot_reading_age_seconds,omitempty"`
	Relay          *Status    `json:"relay,omitempty"`
}

// slotReport builds /slot from the poller's cached reading: a request
// never opens a PostgreSQL connection, so scraping it cannot exhaust the
// server's connections or hang on a dead one.
func (r *Relay) slotReport(now time.Time) SlotReport {
	status := r.Status()
	reading := r.slotReading()
	report := SlotReport{Relay: &status, Slot: reading.info, SlotError: reading.err}
	if reading.at.IsZero() {
		report.SlotError = "the slot has not been read yet; the relay reads it every few seconds"
		return report
	}
	at, age := reading.at, now.Sub(reading.at).Seconds()
	report.SlotReadAt, report.SlotAgeSeconds = &at, &age
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
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		ready, reason := r.Ready()
		if !ready {
			http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ready\n"))
	})
	mux.HandleFunc("GET /slot", func(w http.ResponseWriter, _ *http.Request) {
		report := r.slotReport(time.Now())
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(report)
	})
	if gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
	return mux
}
