package pipeline

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestAdminHandlerServesTheSourcesDocumentAndHintsAtTheOthers(t *testing.T) {
	reg := prometheus.NewRegistry()
	NewMetrics(reg)
	ready, reason := false, "backing-off: kafka down"
	h := AdminHandler(reg, Admin{
		Ready:     func() (bool, string) { return ready, reason },
		Path:      "/poll",
		Document:  func() any { return Status{State: StateBackingOff} },
		Elsewhere: map[string]string{"/slot": "no slot here: see /poll"},
	})
	get := func(path string) (int, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		body, _ := io.ReadAll(rec.Body)
		return rec.Code, string(body)
	}
	for _, c := range []struct {
		path string
		code int
		want string
	}{
		{"/healthz", 200, "ok"},
		{"/readyz", 503, "not ready: backing-off: kafka down"},
		{"/poll", 200, `"state": "backing-off"`},
		{"/slot", 404, "no slot here: see /poll"},
		{"/metrics", 200, `outbox_relay_state{state="polling"} 0`},
	} {
		code, body := get(c.path)
		if code != c.code || !strings.Contains(body, c.want) {
			t.Errorf("%s: %d %q, want %d with %q", c.path, code, body, c.code, c.want)
		}
	}
	ready = true
	if code, body := get("/readyz"); code != 200 || body != "ready\n" {
		t.Errorf("/readyz when ready: %d %q", code, body)
	}
}
