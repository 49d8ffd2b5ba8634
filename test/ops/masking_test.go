package ops

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// A password that is also a word, or a single letter, must not be hidden
// by replacing its text: that garbled every message containing it ("user
// xxxxx_…", "pxxxxxssword") and so gave it away. The server is always
// shown as host, port, user and database built from the parsed DSN, in
// logs, exit messages, /readyz, /slot and STATUS=.
func TestSecurityPasswordsThatAreWords(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.Migrate()
	role := "app_" + e.Slot
	createRole(t, role, "REPLICATION", "app")
	e.DB.Exec(t, "GRANT SELECT, INSERT, UPDATE ON outbox_quarantine TO "+role)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadPort := ln.Addr().(*net.TCPAddr).Port
	ln.Close()

	kv := func(port int, password string) string {
		return fmt.Sprintf("host=127.0.0.1 port=%d user=%s password=%s dbname=%s sslmode=disable connect_timeout=5", port, role, password, e.DB.Name())
	}
	described := func(port int) string {
		return fmt.Sprintf("host=127.0.0.1 port=%d user=%s dbname=%s", port, role, e.DB.Name())
	}
	garbled := func(what, text string) {
		t.Helper()
		if strings.Contains(text, "xxxxx") {
			t.Errorf("%s masks text instead of describing the server:\n%s", what, harness.LastLines(text, 20))
		}
	}

	t.Run("streaming, password app", func(t *testing.T) {
		sock := listenNotify(t)
		p := e.start(e.argsAs(e.DB.DSNFor(role, "app"), "run"), sock.env(0)...)
		p.WaitForOutput(t, `"message":"streaming"`, time.Minute)
		if want := fmt.Sprintf(`"postgres":%q`, described(cluster.Port())); !strings.Contains(p.Output(), want) {
			t.Errorf("the starting line does not show %s:\n%s", want, harness.LastLines(p.Output(), 10))
		}
		base := p.AdminURL(t)
		for _, path := range []string{"/slot", "/readyz"} {
			_, body := harness.HTTPGet(t, base+path)
			garbled(path, body)
		}
		if p.Exited() {
			t.Fatalf("the relay exited before SIGTERM:\n%s", harness.LastLines(p.Output(), 10))
		}
		if code, err := p.Stop(time.Minute); err != nil || code != 0 {
			t.Errorf("SIGTERM: exit %d (%v)", code, err)
		}
		garbled("the relay's output", p.Output())
		garbled("STATUS=", sock.lines())
	})

	// The role's password is app; a is wrong and appears in every word
	// with an a in it.
	t.Run("wrong password a", func(t *testing.T) {
		dsn := kv(cluster.Port(), "a")
		p := e.start(e.argsAs(dsn, "run"))
		if code, err := p.Wait(time.Minute); err != nil || code != 1 {
			t.Fatalf("run with a wrong password: exit %d (%v), want 1", code, err)
		}
		out := p.Output()
		if !strings.Contains(out, "password authentication failed for user") || !strings.Contains(out, role) {
			t.Errorf("run's error is not readable:\n%s", harness.LastLines(out, 10))
		}
		garbled("run's output", out)
		for _, cmd := range []string{"status", "migrate"} {
			code, out := e.run(e.argsAs(dsn, cmd))
			if code != 1 || !strings.Contains(out, "password authentication failed for user") {
				t.Errorf("%s with a wrong password: exit %d, want 1 with a readable error:\n%s", cmd, code, out)
			}
			garbled(cmd+"'s output", out)
		}
	})

	t.Run("unreachable server, password a", func(t *testing.T) {
		sock := listenNotify(t)
		p := e.start(e.argsAs(kv(deadPort, "a"), "run"), sock.env(0)...)
		base := p.AdminURL(t)
		var body string
		var code int
		harness.WaitFor(t, time.Minute, "/readyz naming the unreachable server", func() bool {
			code, body = harness.HTTPGet(t, base+"/readyz")
			return code == http.StatusServiceUnavailable && strings.Contains(body, fmt.Sprint(deadPort))
		})
		garbled("/readyz", body)
		harness.WaitFor(t, time.Minute, "STATUS= with the connect error", func() bool {
			return strings.Contains(sock.lines(), fmt.Sprint(deadPort))
		})
		garbled("STATUS=", sock.lines())
		_, slot := harness.HTTPGet(t, base+"/slot")
		garbled("/slot", slot)
		p.Kill()
		garbled("the relay's output", p.Output())
		for _, cmd := range [][]string{{"status"}, {"migrate"}, {"quarantine", "list"}} {
			args := append(cmd, "--pg-dsn", kv(deadPort, "a"))
			code, out := e.run(args)
			if code != 1 {
				t.Errorf("%v against an unreachable server: exit %d, want 1:\n%s", cmd, code, out)
			}
			garbled(strings.Join(cmd, " ")+"'s output", out)
		}
	})
}
