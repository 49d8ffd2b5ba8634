package ops

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// templateInstance is one outbox-relay@<name> of the template unit.
type templateInstance struct {
	name      string
	db        *harness.PGDatabase
	slot      string
	adminAddr string
	ids       []string
	before    string // the WAL position before its events
	proc      *harness.Process
}

// templateCommand is the command line and environment the template unit
// runs for instance name: its ExecStart and Environment= with %i replaced,
// the installed binary replaced by bin and /etc/outbox-relay/ by confDir.
func templateCommand(t *testing.T, name, bin, confDir string) (args, env []string) {
	t.Helper()
	_, directives := readUnit(t, "outbox-relay@.service")
	expand := func(s string) string {
		s = strings.ReplaceAll(s, "%i", name)
		s = strings.ReplaceAll(s, installedBinary, bin)
		return strings.ReplaceAll(s, "/etc/outbox-relay/", confDir+string(filepath.Separator))
	}
	execStart := unitValues(directives, "ExecStart")
	if len(execStart) != 1 {
		t.Fatalf("outbox-relay@.service has %d ExecStart lines", len(execStart))
	}
	if strings.ContainsAny(execStart[0], `"'\$`) {
		t.Fatalf("ExecStart %q needs systemd's quoting rules, which this test does not implement", execStart[0])
	}
	argv := strings.Fields(expand(execStart[0]))
	if argv[0] != bin {
		t.Fatalf("ExecStart %q does not start %s", execStart[0], installedBinary)
	}
	for _, e := range unitValues(directives, "Environment") {
		env = append(env, strings.Fields(expand(e))...)
	}
	return argv[1:], env
}

// Two instances of the template unit on one host, each for its own database
// of one PostgreSQL cluster, run side by side against one Kafka cluster:
// each streams from its own slot, answers on its own admin address, keeps
// its own progress record in the shared progress topic, and delivers its
// own database's events, all of them, to its own topics.
func TestTemplateUnitTwoInstances(t *testing.T) {
	t.Parallel()
	bin := harness.BuildRelay(t)
	kafka := harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: 3})
	confDir := t.TempDir()

	instances := []*templateInstance{{name: "orders"}, {name: "billing"}}
	for _, in := range instances {
		in.db, in.slot = cluster.CreateRelayDatabase(t)
		in.adminAddr = fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
		// What must differ between instances: the database, the slot
		// and the admin address; the topic template keeps each
		// database's events apart. Publication, table, quarantine table
		// and progress topic stay at their defaults, shared by name.
		conf := fmt.Sprintf("pg-dsn: %q\nslot: %s\nkafka-brokers: %q\nadmin-addr: %q\ntopic: %q\nlog-level: info\n",
			in.db.DSN(), in.slot, kafka.BrokerList(), in.adminAddr, in.name+".{aggregate_type}")
		if err := os.WriteFile(filepath.Join(confDir, in.name+".yaml"), []byte(conf), 0o640); err != nil {
			t.Fatal(err)
		}
		// Every command reads the instance's file: migrate creates its
		// table, publication and slot.
		harness.Migrate(t, bin, []string{"migrate", "--config", filepath.Join(confDir, in.name+".yaml")})
		args, env := templateCommand(t, in.name, bin, confDir)
		t.Logf("outbox-relay@%s: %s %s (env %s)", in.name, bin, strings.Join(args, " "), strings.Join(env, " "))
		in.proc = harness.StartProcess(t, bin, args, env)
	}
	for _, in := range instances {
		in.proc.WaitForOutput(t, harness.LogStreaming, 2*time.Minute)
	}

	for _, in := range instances {
		in.before = in.db.CurrentLSN(t)
		in.ids = insert(t, in.db.DSN(), "order", 40)
	}
	for _, in := range instances {
		records := harness.ConsumeEventIDs(t, kafka.Brokers(), "^"+regexp.QuoteMeta(in.name)+`\.`, in.ids, time.Minute)
		own := map[string]bool{}
		for _, id := range in.ids {
			own[id] = true
		}
		for _, r := range records {
			if !own[r.EventID()] {
				t.Errorf("%s received event %s, which is not of its database", r.Topic, r.EventID())
			}
		}
		t.Logf("outbox-relay@%s: %d records for %d events", in.name, len(records), len(in.ids))
	}

	// Each admin endpoint is its own instance's, streaming its own slot.
	pids := map[int]string{}
	for _, in := range instances {
		url := "http://" + in.adminAddr
		if status, body := harness.HTTPGet(t, url+"/readyz"); status != 200 {
			t.Errorf("outbox-relay@%s /readyz: %d %s", in.name, status, body)
		}
		var doc struct {
			Slot struct {
				Name      string `json:"slot_name"`
				Database  string `json:"database"`
				Active    bool   `json:"active"`
				ActivePID *int   `json:"active_pid"`
			} `json:"slot"`
			Relay struct {
				State    string `json:"state"`
				Progress *struct {
					Topic string `json:"topic"`
				} `json:"progress"`
			} `json:"relay"`
		}
		// The slot watch reads every 5 s; wait for a reading that
		// shows the slot in use.
		harness.WaitFor(t, 30*time.Second, in.name+"'s /slot showing its active slot", func() bool {
			status, body := harness.HTTPGet(t, url+"/slot")
			return status == 200 && json.Unmarshal([]byte(body), &doc) == nil && doc.Slot.Active && doc.Slot.ActivePID != nil
		})
		if doc.Slot.Name != in.slot || doc.Slot.Database != in.db.Name() || doc.Relay.State != "streaming" {
			t.Errorf("outbox-relay@%s /slot: slot %s of database %s, state %s; want slot %s of %s, streaming",
				in.name, doc.Slot.Name, doc.Slot.Database, doc.Relay.State, in.slot, in.db.Name())
		}
		if doc.Relay.Progress == nil || doc.Relay.Progress.Topic != "outbox-relay.progress" {
			t.Errorf("outbox-relay@%s /slot: progress %+v, want the shared topic outbox-relay.progress", in.name, doc.Relay.Progress)
		}
		// PostgreSQL agrees: each slot is active, held by a walsender
		// of its own, in its own database.
		var active bool
		var pid int
		var database string
		conn := in.db.Connect(t)
		if err := conn.QueryRow(t.Context(), `SELECT active, active_pid, database FROM pg_replication_slots WHERE slot_name = $1`, in.slot).
			Scan(&active, &pid, &database); err != nil {
			t.Fatalf("pg_replication_slots %s: %v", in.slot, err)
		}
		if !active || database != in.db.Name() || pid != *doc.Slot.ActivePID {
			t.Errorf("pg_replication_slots %s: active %v, pid %d, database %s; the relay saw pid %d, database %s",
				in.slot, active, pid, database, *doc.Slot.ActivePID, in.db.Name())
		}
		if other, seen := pids[pid]; seen {
			t.Errorf("outbox-relay@%s and outbox-relay@%s share walsender %d", in.name, other, pid)
		}
		pids[pid] = in.name
	}

	// Each keeps its own progress record in the shared topic, keyed by
	// its slot and the cluster, past where its events began.
	systemID := instances[0].db.QueryString(t, "SELECT system_identifier::text FROM pg_control_system()")
	before := map[string]string{}
	for _, in := range instances {
		before[in.slot+"@"+systemID] = in.before
	}
	latest := map[string]string{}
	harness.WaitFor(t, time.Minute, "a progress record past the start of its events for each instance", func() bool {
		for _, r := range harness.ConsumeToEnd(t, kafka.Brokers(), "outbox-relay.progress", 30*time.Second) {
			var rec struct {
				LSN string `json:"lsn"`
			}
			if err := json.Unmarshal(r.Value, &rec); err != nil {
				t.Fatalf("progress record %s: %v", r.Key, err)
			}
			latest[string(r.Key)] = rec.LSN
		}
		for key, start := range before {
			if !harness.LSNAtMost(start, latest[key]) || latest[key] == start {
				return false
			}
		}
		return true
	})
	if len(latest) != len(instances) {
		t.Errorf("progress records %v, want one key per instance: %v", latest, before)
	}

	// Both stop cleanly, each draining its own stream.
	for _, in := range instances {
		if code, err := in.proc.Stop(time.Minute); err != nil || code != 0 {
			t.Errorf("outbox-relay@%s: SIGTERM gave exit %d (%v)", in.name, code, err)
		}
	}
}
