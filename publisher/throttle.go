package publisher

import (
	"strings"
	"sync"
	"time"

	metrics "github.com/rcrowley/go-metrics"
	"github.com/rs/zerolog"
)

// Throttle counts the time the brokers ask the relay's Kafka clients to
// wait before their next request: a quota (producer_byte_rate,
// request_percentage) the relay's traffic exceeds answers each request
// with a throttle time, and sarama waits it out. Nothing fails, the relay
// only slows down; without this it would slow down in silence.
//
// One Throttle serves every client of a process.
type Throttle struct {
	log zerolog.Logger

	mu       sync.Mutex
	observe  func(time.Duration)
	since    time.Time     // start of the window being summed for the log
	total    time.Duration // throttled within it
	requests int
}

// throttleLogEvery bounds the warnings to one a minute while throttled.
const throttleLogEvery = time.Minute

// NewThrottle logs to log.
func NewThrottle(log zerolog.Logger) *Throttle { return &Throttle{log: log} }

// Observe has fn told every throttle time (for the metric); set it before
// the first client is made.
func (t *Throttle) Observe(fn func(time.Duration)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.observe = fn
}

func (t *Throttle) add(d time.Duration) {
	if t == nil || d <= 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.observe != nil {
		t.observe(d)
	}
	now := time.Now()
	if t.since.IsZero() {
		t.since = now
	}
	t.total += d
	t.requests++
	if now.Sub(t.since) < throttleLogEvery && t.requests > 1 {
		return
	}
	t.log.Warn().Dur("throttled", t.total).Int("requests", t.requests).Dur("within", now.Sub(t.since)).
		Msg("the brokers throttle the relay's Kafka requests: a quota on its client id or user is exceeded, and publishing slows down to it (outbox_relay_kafka_throttle_seconds_total). Raise the quota (kafka-configs.sh --alter --entity-type clients --entity-name outbox-relay --add-config producer_byte_rate=...) if the relay must keep up")
	t.since, t.total, t.requests = now, 0, 0
}

// throttleHistogram takes sarama's per-broker throttle-time histogram:
// only its updates matter here.
type throttleHistogram struct {
	metrics.NilHistogram
	t *Throttle
}

func (h throttleHistogram) Update(ms int64) { h.t.add(time.Duration(ms) * time.Millisecond) }

// isThrottleMetric says whether sarama registers name for a broker's
// throttle times ("throttle-time-in-ms-for-broker-<id>").
func isThrottleMetric(name string) bool { return strings.HasPrefix(name, "throttle-time-in-ms") }
