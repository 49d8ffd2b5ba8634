package pipeline

import (
	"encoding/json"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Admin is a source's side of the admin endpoint.
type Admin struct {
	// Ready reports whether the source publishes, and why not.
	Ready func() (bool, string)
	// Path serves Document, the source's own JSON document (/slot, /poll).
	Path     string
	Document func() any
	// Elsewhere answers 404 with a hint at these paths: those of the
	// other sources' documents.
	Elsewhere map[string]string
}

// AdminHandler serves the read-only admin endpoint: /healthz, /readyz,
// /metrics (gatherer; none when nil) and the source's document. Every
// answer comes from what the source keeps: a request never opens a
// PostgreSQL connection, so scraping cannot exhaust the server's
// connections or hang on a dead one.
func AdminHandler(gatherer prometheus.Gatherer, a Admin) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		ready, reason := a.Ready()
		if !ready {
			http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ready\n"))
	})
	mux.HandleFunc("GET "+a.Path, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(a.Document())
	})
	for path, hint := range a.Elsewhere {
		mux.HandleFunc("GET "+path, func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, hint, http.StatusNotFound)
		})
	}
	if gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
	return mux
}
