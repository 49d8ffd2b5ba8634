package ops

import (
	"encoding/json"
	"strings"
	"testing"
)

// `outbox-relay status` reads the slot straight from PostgreSQL: it needs
// no running relay, and says what to do when the slot is missing.
func TestStatusCommand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)

	code, out := e.run(e.args("status"))
	if code == 0 || !strings.Contains(out, "does not exist") || !strings.Contains(out, "outbox-relay migrate") {
		t.Errorf("status of a missing slot exited %d:\n%s\nwant non-zero and advice to run migrate", code, out)
	}

	e.migrate()
	statusJSON := func() map[string]any {
		t.Helper()
		code, out := e.run(e.args("status"))
		if code != 0 {
			t.Fatalf("status exited %d:\n%s", code, out)
		}
		var doc map[string]any
		if err := json.Unmarshal([]byte(out), &doc); err != nil {
			t.Fatalf("status printed no JSON (%v):\n%s", err, out)
		}
		return doc
	}
	doc := statusJSON()
	si := cluster.SlotInfo(t, e.db.Name(), e.slot)
	want := map[string]any{"slot_name": e.slot, "plugin": "pgoutput", "database": e.db.Name(), "active": false,
		"active_pid": nil, "confirmed_flush_lsn": si.ConfirmedFlush, "restart_lsn": si.RestartLSN, "wal_status": "reserved"}
	for k, v := range want {
		if doc[k] != v {
			t.Errorf("status .%s = %v, want %v", k, doc[k], v)
		}
	}
	for _, k := range []string{"current_wal_lsn", "retained_wal_bytes", "lag_bytes", "safe_wal_size"} {
		if _, ok := doc[k]; !ok {
			t.Errorf("status has no %q: %v", k, doc)
		}
	}

	// With a relay streaming, status shows the slot active and its pid.
	p := e.startStreaming()
	defer p.Kill()
	doc = statusJSON()
	si = cluster.SlotInfo(t, e.db.Name(), e.slot)
	if doc["active"] != true || doc["active_pid"] != float64(si.ActivePID) {
		t.Errorf("status with a relay streaming: active %v pid %v; pg_replication_slots: %+v", doc["active"], doc["active_pid"], si)
	}
}
