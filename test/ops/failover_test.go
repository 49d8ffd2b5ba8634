package ops

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// Failover slots (synchronised to physical standbys) exist from PostgreSQL
// 17 on. On an older server --slot-failover must refuse clearly, whichever
// command would create the slot, and create nothing.
func TestSlotFailoverNeedsPostgres17(t *testing.T) {
	t.Parallel()
	if v := cluster.QueryInt64(t, "SELECT current_setting('server_version_num')::int"); v >= 170000 {
		t.Skipf("PostgreSQL %d supports failover slots; this test is about older servers", v)
	}
	// The refusal names the server's release as PostgreSQL does (15.18),
	// not as numbered before version 10 (it said 15.0).
	release := strings.Fields(cluster.QueryString(t, "SELECT current_setting('server_version')"))[0]
	check := func(t *testing.T, e *env, what string, code int, out string) {
		t.Helper()
		if !strings.Contains(out, "this server is "+release+":") {
			t.Errorf("%s --slot-failover does not name the server's release %s:\n%s", what, release, harness.LastLines(out, 10))
		}
		if code == 0 {
			t.Errorf("%s --slot-failover exited 0 on PostgreSQL < 17:\n%s", what, out)
		}
		if !strings.Contains(out, "--slot-failover needs PostgreSQL 17 or newer") {
			t.Errorf("%s --slot-failover does not say it needs PostgreSQL 17:\n%s", what, harness.LastLines(out, 10))
		}
		if si := cluster.SlotInfo(t, e.DB.Name(), e.Slot); si.Exists {
			t.Errorf("%s --slot-failover created a slot anyway: %+v", what, si)
		}
	}

	t.Run("migrate creates the slot", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		code, out := e.run(e.Args("migrate", "--slot-failover"))
		check(t, e, "migrate", code, out)
	})
	t.Run("the relay creates the slot", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		e.Migrate("--skip-slot")
		p := e.start(e.Args("run", "--slot-failover"))
		code, err := p.Wait(time.Minute)
		if err != nil {
			t.Fatalf("run --slot-failover without a slot is still running after a minute; it must stop: %v\n%s", err, harness.LastLines(p.Output(), 10))
		}
		check(t, e, "run", code, p.Output())
	})
	// The flag is a promise that the slot survives a failover of the
	// primary. A slot that already exists without it must not be streamed
	// from as if it were one.
	t.Run("the slot already exists", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		e.Migrate()
		p := e.start(e.Args("run", "--slot-failover"))
		streaming := func() bool { return strings.Contains(p.Output(), `"message":"streaming"`) }
		harness.WaitFor(t, time.Minute, "the relay to refuse (or to stream)", func() bool { return p.Exited() || streaming() })
		if streaming() {
			t.Fatalf("the relay streams from a slot that is not a failover slot although --slot-failover was given:\n%s", harness.LastLines(p.Output(), 5))
		}
		code, err := p.Wait(time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if code == 0 || !strings.Contains(p.Output(), "--slot-failover needs PostgreSQL 17 or newer") {
			t.Errorf("run --slot-failover on an existing slot exited %d:\n%s", code, harness.LastLines(p.Output(), 10))
		}
	})
}
