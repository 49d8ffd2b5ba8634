package poll

import (
	"encoding/json"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// AdminHandler serves poll mode's read-only admin endpoint: /healthz,
// /readyz, /poll (the poller's status and the table's state as last read:
// a request never opens a PostgreSQL connection) and /metrics. /slot says
// that poll mode has none.
func (p *Poller) AdminHandler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		s := p.Status()
		if s.State != StatePolling {
			reason := s.State
			if s.Error != "" {
				reason += ": " + s.Error
			}
			http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ready\n"))
	})
	mux.HandleFunc("GET /poll", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(p.Status())
	})
	mux.HandleFunc("GET /slot", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "poll mode (--source poll) holds no replication slot: see /poll", http.StatusNotFound)
	})
	if gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
	return mux
}
