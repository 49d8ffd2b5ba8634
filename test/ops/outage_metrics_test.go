package ops

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// deadAddr is a local address nobody listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// Issue 30: with Kafka down and events committed, the relay waits outside
// the stream: it reads none of them, so nothing is in flight and
// outbox_relay_oldest_unpublished_event_age_seconds stayed 0 while /slot
// showed the slot behind, and the age alert could not fire. Outside the
// stream the age now comes from the slot's position; once Kafka is back
// every event is delivered (read back with the independent client) and
// the age falls back.
func TestUnpublishedAgeWhileKafkaIsDown(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	live := e.Brokers
	e.Brokers = []string{deadAddr(t)}
	p := e.start(e.Args("run", "--kafka-timeout", "1s"))
	base := p.AdminURL(t)
	harness.WaitFor(t, time.Minute, "a failed attempt to reach Kafka", func() bool {
		return harness.Metric(t, base, "outbox_relay_stream_restarts_total") >= 1
	})
	ids := insert(t, e.DB.DSN(), "order", 50)
	harness.WaitFor(t, time.Minute, "the slot watch to see the slot behind", func() bool {
		return getSlot(t, base).Slot != nil && getSlot(t, base).Slot["lag_bytes"].(float64) > 0
	})
	var age float64
	harness.WaitFor(t, 30*time.Second, "the age of the oldest unpublished event to pass 5 s while Kafka is down", func() bool {
		age = harness.Metric(t, base, "outbox_relay_oldest_unpublished_event_age_seconds")
		return age >= 5
	})
	if n := harness.Metric(t, base, "outbox_relay_in_flight_events"); n != 0 {
		t.Errorf("outbox_relay_in_flight_events = %v while the relay cannot reach Kafka; the age must not rest on it", n)
	}
	t.Logf("Kafka down: oldest unpublished event age %.1f s with nothing in flight", age)
	p.Kill()

	e.Brokers = live
	q := e.StartRelay()
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, ids, time.Minute)
	qbase := q.AdminURL(t)
	harness.WaitFor(t, time.Minute, "the age to fall back once the events are published", func() bool {
		return harness.Metric(t, qbase, "outbox_relay_oldest_unpublished_event_age_seconds") < 5
	})
}

// Issue 30: with PostgreSQL unreachable the slot gauges kept their last
// values while /slot said "slot": null. outbox_relay_slot_reading_age_seconds
// now says how old the values are.
func TestSlotReadingAgeWhilePostgresIsUnreachable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	role := "sra_" + e.Slot
	const pass = "sra-pw-5d0e"
	createRole(t, role, "REPLICATION", pass)
	e.DB.Exec(t, "GRANT SELECT, INSERT, UPDATE ON outbox_quarantine TO "+role)
	proxy := harness.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", cluster.Port()))
	url := e.DB.DSNFor(role, pass)
	dsn := strings.Replace(url, fmt.Sprintf(":%d/", cluster.Port()), fmt.Sprintf(":%d/", proxy.Port()), 1)
	if dsn == url {
		t.Fatalf("cannot point the DSN at the proxy")
	}
	p := harness.StartStreaming(t, e.Bin, e.argsAs(dsn, "run"))
	base := p.AdminURL(t)
	harness.WaitFor(t, time.Minute, "a fresh reading of the slot", func() bool {
		return harness.Metric(t, base, "outbox_relay_slot_reading_age_seconds") < 10
	})
	proxy.Pause()
	proxy.CutAll()
	harness.WaitFor(t, time.Minute, "/slot to say the slot cannot be read", func() bool { return getSlot(t, base).Slot == nil })
	harness.WaitFor(t, time.Minute, "the slot reading's age to pass 10 s", func() bool {
		return harness.Metric(t, base, "outbox_relay_slot_reading_age_seconds") >= 10
	})
	proxy.Resume()
	harness.WaitFor(t, time.Minute, "a fresh reading once PostgreSQL is back", func() bool {
		return harness.Metric(t, base, "outbox_relay_slot_reading_age_seconds") < 10
	})
}
