package main

import (
	"runtime/debug"

	"github.com/outbox-relay/outbox-relay/relay"
)

// gcPercent is the relay's default GOGC. Its live heap is small and held
// there by the in-flight window, so the collector can run a third as often
// for little memory. Measured while catching up on the 2-core benchmark
// machine, with the 2,000-event window: about 16% less CPU per event than
// GOGC=100 with the former 10,000-event window, peak RSS 47-52 MB.
const gcPercent = 300

// gcPercentExactlyOnce is the default GOGC in exactly-once mode. Its live
// heap is larger, a Kafka transaction's records held until the commit, and
// GOGC=300 let the heap grow to four times that. Draining 200,000
// single-row transactions on Apache Kafka with 10,000-event transactions,
// on a quiet machine: 68-76 MB peak RSS at GOGC=150, 63 MB at GOGC=100, at
// the same rate.
const gcPercentExactlyOnce = 100

// tuneGC sets the relay's garbage collector defaults unless the operator set
// GOGC or GOMEMLIMIT, which always win. The soft memory limit keeps a window
// of large records (up to --max-in-flight-bytes) from growing the heap to
// four times its size. It returns what it applied (-1: left alone).
func tuneGC(cfg relay.Config, getenv func(string) string) (percent int, limit int64) {
	percent, limit = -1, -1
	if getenv("GOGC") == "" {
		percent = gcPercent
		if cfg.DeliveryMode() == relay.DeliveryExactlyOnce {
			percent = gcPercentExactlyOnce
		}
		debug.SetGCPercent(percent)
	}
	if getenv("GOMEMLIMIT") == "" {
		limit = 64<<20 + 2*cfg.MaxInFlightBytes
		debug.SetMemoryLimit(limit)
	}
	return percent, limit
}

// reconcileMemoryLimit is reconcile's soft memory limit. Its live heap is
// the window's event ids (20 bytes a row) and the fetch responses being
// read; without a limit the collector let the garbage of decoding records
// grow the heap to several times that (peak RSS 184 MB for a
// 1,000,000-row window, 11 MB of it live).
const reconcileMemoryLimit = 96 << 20

// tuneReconcileGC applies reconcileMemoryLimit unless the operator set
// GOMEMLIMIT. It is soft: a larger window still fits, with more collection.
func tuneReconcileGC(getenv func(string) string) (limit int64) {
	if getenv("GOMEMLIMIT") != "" {
		return -1
	}
	debug.SetMemoryLimit(reconcileMemoryLimit)
	return reconcileMemoryLimit
}
