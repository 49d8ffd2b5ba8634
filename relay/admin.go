package relay

import (
	"context"
	"encoding/json"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outbox-relay/outbox-relay/replication"
)

// SlotReport is the /slot document: the server's view of the slot beside
// the relay's own.
type SlotReport struct {
	Slot      *replication.SlotInfo `json:"slot"`
	SlotError string                `json:"slot_error,omitempty"`
	Relay     *Status               `json:"relay,omitempty"`
}

// ReadSlot reads the slot's state from PostgreSQL on a short-lived
// connection. It works whether or not a relay is streaming.
func ReadSlot(ctx context.Context, cfg replication.Config) (*replication.SlotInfo, error) {
	admin, err := replication.Connect(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer admin.Close(context.Background())
	info, ok, err := admin.Slot(ctx)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, &slotMissingError{slot: cfg.Slot}
	}
	return info, nil
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
	mux.HandleFunc("GET /slot", func(w http.ResponseWriter, req *http.Request) {
		ctx, cancel := context.WithTimeout(req.Context(), 5*time.Second)
		defer cancel()
		status := r.Status()
		report := SlotReport{Relay: &status}
		info, err := ReadSlot(ctx, r.cfg.Replication)
		if err != nil {
			report.SlotError = replication.RedactError(err.Error(), r.cfg.Replication.DSN)
		}
		report.Slot = info
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
