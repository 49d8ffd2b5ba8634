package main

import (
	"math"
	"runtime/debug"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
)

func TestTuneGC(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(math.MaxInt64))
	cfg := relay.DefaultConfig()

	percent, limit := tuneGC(cfg, func(string) string { return "" })
	if percent != gcPercent || debug.SetGCPercent(gcPercent) != gcPercent {
		t.Errorf("GOGC unset: applied %d, want %d", percent, gcPercent)
	}
	if want := int64(64<<20) + 2*cfg.MaxInFlightBytes; limit != want || debug.SetMemoryLimit(-1) != want {
		t.Errorf("GOMEMLIMIT unset: limit %d, want %d", limit, want)
	}

	cfg.Delivery = relay.DeliveryExactlyOnce
	if percent, _ := tuneGC(cfg, func(string) string { return "" }); percent != gcPercentExactlyOnce {
		t.Errorf("exactly-once, GOGC unset: applied %d, want %d", percent, gcPercentExactlyOnce)
	}

	// The operator's settings win: nothing is touched.
	debug.SetGCPercent(150)
	debug.SetMemoryLimit(1 << 30)
	percent, limit = tuneGC(cfg, func(k string) string { return map[string]string{"GOGC": "150", "GOMEMLIMIT": "1GiB"}[k] })
	if percent != -1 || limit != -1 || debug.SetGCPercent(150) != 150 || debug.SetMemoryLimit(-1) != 1<<30 {
		t.Errorf("GOGC and GOMEMLIMIT set: tuneGC applied %d, %d", percent, limit)
	}
}
