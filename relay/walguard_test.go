package relay

import (
	"math"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/replication"
)

// The guard divides what max_slot_wal_keep_size still allows by the WAL
// rate of the last minute; while no one streams, idle_replication_slot_timeout
// may come first; with neither limit the slot lasts for ever.
func TestWALGuardTimeLeft(t *testing.T) {
	t0 := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	safe := func(n int64) *int64 { return &n }
	// 1 MB/s for two minutes, in 5 s readings: only the last minute counts,
	// then 4 MB/s in it.
	var g walGuard
	end := lsn.LSN(1 << 30)
	for i := 0; i <= 24; i++ {
		if i > 0 {
			end += 5 << 20
		}
		g.note(t0.Add(time.Duration(i)*5*time.Second), end)
	}
	if rate, ok := g.rate(); !ok || rate != 1<<20 {
		t.Fatalf("rate after two minutes at 1 MiB/s: %v (ok %v)", rate, ok)
	}
	for i := 25; i <= 36; i++ {
		end += 20 << 20
		g.note(t0.Add(time.Duration(i)*5*time.Second), end)
	}
	now := t0.Add(36 * 5 * time.Second)
	rate, _ := g.rate()
	if rate != 4<<20 {
		t.Fatalf("rate over the last minute: %.0f B/s, want %d", rate, 4<<20)
	}
	inactive := now.Add(-10 * time.Minute)
	for _, c := range []struct {
		name  string
		info  replication.SlotInfo
		idle  time.Duration
		left  float64
		limit string
	}{
		{name: "no limit", info: replication.SlotInfo{Active: true}, left: math.Inf(1)},
		{name: "keep size", info: replication.SlotInfo{Active: true, SafeWALSize: safe(400 << 20)}, left: 100, limit: "max_slot_wal_keep_size"},
		{name: "keep size used up", info: replication.SlotInfo{SafeWALSize: safe(-5)}, left: 0, limit: "max_slot_wal_keep_size"},
		{name: "idle timeout first", info: replication.SlotInfo{SafeWALSize: safe(4000 << 20), InactiveSince: &inactive}, idle: 12 * time.Minute, left: 120, limit: "idle_replication_slot_timeout"},
		{name: "keep size first", info: replication.SlotInfo{SafeWALSize: safe(40 << 20), InactiveSince: &inactive}, idle: 12 * time.Minute, left: 10, limit: "max_slot_wal_keep_size"},
		{name: "idle timeout while streaming", info: replication.SlotInfo{Active: true, InactiveSince: &inactive}, idle: time.Minute, left: math.Inf(1)},
		{name: "idle timeout passed", info: replication.SlotInfo{InactiveSince: &inactive}, idle: time.Minute, left: 0, limit: "idle_replication_slot_timeout"},
	} {
		got := g.reading(&c.info, replication.SlotLimits{IdleTimeout: c.idle}, now)
		if got.Left != c.left || got.Limit != c.limit {
			t.Errorf("%s: %v s left by %q, want %v by %q", c.name, got.Left, got.Limit, c.left, c.limit)
		}
	}
	// A server whose WAL end went back is another server (a promoted
	// standby on a new timeline shares none of the readings).
	g.note(now.Add(5*time.Second), 1<<20)
	if _, ok := g.rate(); ok {
		t.Error("a rate across a WAL end that went back")
	}
}
