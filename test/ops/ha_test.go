package ops

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// takeoverBound is what the HA pattern promises: a standby streams within
// this long of the active instance's death. The standby polls the slot every
// one to two seconds; the rest is connecting.
const takeoverBound = 10 * time.Second

// Two instances on one slot: one streams, the other waits as a standby
// (ready for systemd, not ready for traffic). SIGKILL the active one and
// the standby takes over within takeoverBound, with no event lost.
func TestStandbyTakesOverWhenTheActiveInstanceDies(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	// Count the producers the standby creates while it waits.
	var producerInits atomic.Int64
	c := e.Kafka.Cluster()
	c.ControlKey(int16(kmsg.InitProducerID), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		producerInits.Add(1)
		return nil, nil, false
	})

	active := e.StartRelay()
	activeAdmin := active.AdminURL(t)
	before := insert(t, e.DB.DSN(), "order", 50)

	sock := listenNotify(t)
	standby := e.start(e.Args("run"), sock.env(0)...)
	standbyAdmin := standby.AdminURL(t)
	harness.WaitFor(t, time.Minute, "the second instance to wait for the slot", func() bool {
		code, body := harness.HTTPGet(t, standbyAdmin+"/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "waiting-for-slot") && strings.Contains(body, "active for PID")
	})
	if code, body := harness.HTTPGet(t, activeAdmin+"/readyz"); code != http.StatusOK {
		t.Fatalf("the active instance answers /readyz %d %q", code, body)
	}
	// The standby is a healthy, started service: without READY=1 systemd
	// would kill it at TimeoutStartSec, forever.
	harness.WaitFor(t, 30*time.Second, "the standby's READY=1 with its standby status", func() bool {
		return sock.count("READY=1") == 1 && sock.count("STATUS=standby: waiting-for-slot: *") > 0
	})
	if strings.Contains(standby.Output(), `"message":"streaming"`) {
		t.Fatal("the standby streamed while the active instance held the slot")
	}
	initsBefore, waitStart := producerInits.Load(), time.Now()
	harness.WaitFor(t, time.Minute, "the standby to retry the slot a few times", func() bool {
		return time.Since(waitStart) > 5*time.Second
	})
	t.Logf("the standby created %d Kafka producers (InitProducerId) in %v of waiting",
		producerInits.Load()-initsBefore, time.Since(waitStart).Round(time.Millisecond))
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, before, time.Minute)

	// Kill the active instance the hard way and time the takeover.
	killed := time.Now()
	active.Kill()
	during := insert(t, e.DB.DSN(), "order", 50)
	harness.WaitFor(t, 30*time.Second, "the standby to take over", func() bool {
		code, _ := harness.HTTPGet(t, standbyAdmin+"/readyz")
		return code == http.StatusOK
	})
	takeover := time.Since(killed)
	t.Logf("takeover after SIGKILL of the active instance: %v", takeover.Round(time.Millisecond))
	if takeover > takeoverBound {
		t.Errorf("the standby took %v to take over, want at most %v", takeover, takeoverBound)
	}
	if si := cluster.SlotInfo(t, e.DB.Name(), e.Slot); !si.Active {
		t.Errorf("the standby says it streams, but the slot is inactive: %+v", si)
	}
	after := insert(t, e.DB.DSN(), "order", 50)
	all := append(append(append([]string{}, before...), during...), after...)
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), topics, all, time.Minute)
	harness.CheckNoLoss(t, records, all)
	if n := sock.count("READY=1"); n != 1 {
		t.Errorf("the standby sent READY=1 %d times, want once", n)
	}
}
