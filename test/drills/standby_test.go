package drills

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// msgWaitingForPromotion is what the relay logs when --pg-dsn leads to a
// hot standby.
const msgWaitingForPromotion = "the PostgreSQL server is a hot standby; waiting for it to be promoted"

// TestDrillRelayWaitsForPromotion points the relay at a hot standby only.
// It retried for ever, logging `read slot …: ERROR: recovery is in progress
// (SQLSTATE 55000)` at every attempt, and /readyz said the same. It must
// recognise the standby, say once that it waits for a promotion (later
// polls log at debug level), give that as the reason in /readyz, and
// stream from the server once it is promoted: every event committed after
// it streams arrives, read by an independent client. Runs on every major.
func TestDrillRelayWaitsForPromotion(t *testing.T) {
	rng := newRand(t)
	pg := harness.StartPostgres(t, harness.PGOptions{})
	w, _ := newKfakeWorld(t, pg)
	standby := pg.CopyStandby(t, "relay_hot_standby", nil)
	n := w.on(standby)
	relay := harness.StartProcess(t, w.Bin, n.args("run", "--admin-addr", "127.0.0.1:0"), []string{"OUTBOX_RELAY_LOG_LEVEL=debug"})
	admin := relay.AdminURL(t)

	waits := func(level string) int {
		c := 0
		for _, l := range harness.LogLines(relay.Output()) {
			if strings.HasPrefix(l.Str("message"), msgWaitingForPromotion) && l.Str("level") == level {
				c++
			}
		}
		return c
	}
	harness.WaitFor(t, time.Minute, "the relay to poll the standby three times after saying it waits", func() bool {
		return relay.Exited() || waits("info") >= 1 && waits("debug") >= 2
	})
	if relay.Exited() {
		t.Fatalf("the relay exited on a hot standby:\n%s", harness.LastLines(relay.Output(), 20))
	}
	if c := waits("info"); c != 1 {
		t.Errorf("the relay said %d times at info level that it waits for a promotion, want once", c)
	}
	if strings.Contains(relay.Output(), "recovery is in progress") {
		t.Errorf("the relay still reports the standby's refusal instead of naming the standby:\n%s", harness.LastLines(relay.Output(), 10))
	}
	code, body := harness.HTTPGet(t, admin+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "waiting-for-promotion") || !strings.Contains(body, "hot standby") {
		t.Errorf("/readyz on a relay waiting on a standby answers %d %q, want 503 naming the wait for a promotion", code, body)
	}
	if strings.Contains(relay.Output(), harness.LogStreaming) {
		t.Fatal("the relay streamed from a standby")
	}

	promoted := time.Now()
	standby.Promote(t)
	relay.WaitForOutput(t, harness.LogStreaming, time.Minute)
	t.Logf("PostgreSQL %d: the relay streamed %v after pg_ctl promote returned", standby.Major(t), time.Since(promoted).Round(time.Millisecond))
	if code, body := harness.HTTPGet(t, admin+"/readyz"); code != http.StatusOK {
		t.Errorf("/readyz after the promotion answers %d %q, want 200", code, body)
	}
	conn := n.connect()
	if err := n.writeTxns(conn, rng, 20, 5, 20); err != nil {
		t.Fatal(err)
	}
	n.checkDelivery(n.waitSettled(time.Minute))
	t.Logf("%d events committed on the promoted server, all delivered", n.CommittedCount())
}
