package poll

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/pipeline"
)

// AdminHandler serves poll mode's read-only admin endpoint: /healthz,
// /readyz, /poll (the poller's status and the table's state as last read)
// and /metrics. /slot says that poll mode has none.
func (p *Poller) AdminHandler(gatherer prometheus.Gatherer) http.Handler {
	return pipeline.AdminHandler(gatherer, pipeline.Admin{
		Ready: p.Ready, Path: "/poll",
		Document:  func() any { return p.Status() },
		Elsewhere: map[string]string{"/slot": "poll mode (--source poll) holds no replication slot: see /poll"},
	})
}
