package relay

import (
	"math"
	"time"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/replication"
)

// walRateWindow is how far back the WAL rate looks: long enough to smooth
// a checkpoint's burst over the slot watch's 5 s readings, short enough to
// follow a batch job that starts writing.
const walRateWindow = time.Minute

// walGuard estimates how long the slot would last if the relay confirmed
// nothing more from now: what the server's limits still allow over how
// fast it writes WAL. It is the slot watch's, which feeds it each reading.
type walGuard struct {
	samples []walSample // within walRateWindow of the newest, oldest first
}

type walSample struct {
	at  time.Time
	end lsn.LSN
}

// guardReading is what the guard says of one reading of the slot.
type guardReading struct {
	// Rate is the server's WAL rate in bytes per second; ok is false
	// until two readings are at least a second apart.
	Rate   float64
	RateOK bool
	// Left is the time left in seconds, +Inf when no limit applies;
	// Limit names the limit that gives it ("" for none).
	Left  float64
	Limit string
}

// note keeps a reading of the server's WAL end taken at at.
func (g *walGuard) note(at time.Time, end lsn.LSN) {
	if n := len(g.samples); n > 0 && end < g.samples[n-1].end {
		g.samples = g.samples[:0] // a new timeline's server, or another server: start again
	}
	g.samples = append(g.samples, walSample{at: at, end: end})
	keep := 0
	for keep < len(g.samples)-2 && at.Sub(g.samples[keep+1].at) >= walRateWindow {
		keep++
	}
	g.samples = g.samples[keep:]
}

// rate is the WAL written per second over the window.
func (g *walGuard) rate() (float64, bool) {
	if len(g.samples) < 2 {
		return 0, false
	}
	first, last := g.samples[0], g.samples[len(g.samples)-1]
	span := last.at.Sub(first.at).Seconds()
	if span < 1 {
		return 0, false
	}
	return float64(last.end-first.end) / span, true
}

// reading says how long the slot info read at now would last:
// safe_wal_size over the WAL rate (max_slot_wal_keep_size), and, while no
// one streams from it, what is left of idle_replication_slot_timeout.
func (g *walGuard) reading(info *replication.SlotInfo, limits replication.SlotLimits, now time.Time) guardReading {
	r := guardReading{Left: math.Inf(1)}
	r.Rate, r.RateOK = g.rate()
	if info.Lost() {
		r.Left, r.Limit = 0, "invalidated"
		return r
	}
	if info.SafeWALSize != nil && r.RateOK {
		switch safe := float64(*info.SafeWALSize); {
		case safe <= 0:
			r.Left, r.Limit = 0, "max_slot_wal_keep_size"
		case r.Rate > 0:
			r.Left, r.Limit = safe/r.Rate, "max_slot_wal_keep_size"
		}
	}
	if limits.IdleTimeout > 0 && !info.Active && info.InactiveSince != nil {
		if idle := (limits.IdleTimeout - now.Sub(*info.InactiveSince)).Seconds(); idle < r.Left {
			r.Left, r.Limit = max(idle, 0), "idle_replication_slot_timeout"
		}
	}
	return r
}
