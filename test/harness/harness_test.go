package harness_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// shared is one cluster for the tests that need no special settings,
// started on first use and stopped by harness.Main, the way suites are
// meant to share a cluster.
var shared harness.SharedPostgres

func sharedPG(t *testing.T) *harness.Postgres { return shared.Get(t) }

func TestPostgresSharedCluster(t *testing.T) {
	pg := sharedPG(t)
	db := pg.CreateTestDatabase(t)
	if got := db.QueryString(t, "SHOW wal_level"); got != "logical" {
		t.Fatalf("wal_level = %q, want logical", got)
	}
	if got := db.QueryString(t, "SHOW listen_addresses"); got != "127.0.0.1" {
		t.Fatalf("listen_addresses = %q, want 127.0.0.1", got)
	}
	if got := db.QueryString(t, "SHOW synchronous_commit"); got != "on" {
		t.Fatalf("synchronous_commit = %q, want on by default", got)
	}
	db.Exec(t, "CREATE TABLE outbox (id bigserial PRIMARY KEY, payload text); INSERT INTO outbox (payload) VALUES ('a'), ('b')")
	if n := db.QueryInt64(t, "SELECT count(*) FROM outbox WHERE payload <> $1", "x"); n != 2 {
		t.Fatalf("count = %d, want 2", n)
	}
	if got := db.QueryString(t, "SELECT NULL::text"); got != "" {
		t.Fatalf("NULL as string = %q, want empty", got)
	}
	if !strings.Contains(db.DSN(), fmt.Sprintf("127.0.0.1:%d/%s", pg.Port(), db.Name())) {
		t.Fatalf("DSN %q does not point at the cluster", db.DSN())
	}

	if si := pg.SlotInfo(t, db.Name(), "nope"); si.Exists || si.ConfirmedFlush != "" {
		t.Fatalf("missing slot reported as %+v", si)
	}
	slot := "s_" + strings.ToLower(strings.ReplaceAll(db.Name(), "-", "_"))
	db.Exec(t, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", slot)
	si := pg.SlotInfo(t, db.Name(), slot)
	if !si.Exists || si.Active || si.ActivePID != 0 || si.ConfirmedFlush == "" || si.RestartLSN == "" || si.WALStatus != "reserved" {
		t.Fatalf("new slot reported as %+v", si)
	}
	if lsn := pg.SlotConfirmedFlushLSN(t, "postgres", slot); lsn != si.ConfirmedFlush {
		t.Fatalf("SlotConfirmedFlushLSN = %q, want %q", lsn, si.ConfirmedFlush)
	}
	db.Exec(t, "SELECT pg_drop_replication_slot($1)", slot)
}

func TestPostgresOptionsAndCrashRestart(t *testing.T) {
	pg := harness.StartPostgres(t, harness.PGOptions{
		PasswordAuth: true,
		Settings: map[string]string{
			"wal_sender_timeout":     "10s",
			"max_slot_wal_keep_size": "64MB",
			"max_wal_senders":        "7", // overrides a harness default
		},
		SynchronousCommitOff: true,
	})
	for setting, want := range map[string]string{
		"wal_sender_timeout":     "10s",
		"max_slot_wal_keep_size": "64MB",
		"max_wal_senders":        "7",
		"synchronous_commit":     "off",
		"wal_level":              "logical",
		"fsync":                  "on",
	} {
		if got := pg.QueryString(t, "SHOW "+setting); got != want {
			t.Errorf("%s = %q, want %q", setting, got, want)
		}
	}

	db := pg.CreateDatabase(t, "app")
	db.Exec(t, "CREATE ROLE relay LOGIN REPLICATION PASSWORD 'secret'; CREATE TABLE t (v int); INSERT INTO t VALUES (1)")
	db.Exec(t, "GRANT SELECT ON t TO relay")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, db.DSNFor("relay", "wrong")); err == nil {
		conn.Close(ctx)
		t.Fatal("wrong password accepted with PasswordAuth")
	}
	conn, err := pgx.Connect(ctx, db.DSNFor("relay", "secret"))
	if err != nil {
		t.Fatalf("connect with password: %v", err)
	}
	var v int
	if err := conn.QueryRow(ctx, "SELECT v FROM t").Scan(&v); err != nil || v != 1 {
		t.Fatalf("query as relay: v=%d err=%v", v, err)
	}
	conn.Close(ctx)
	// A replication connection, as the relay makes it.
	repl, err := pgx.Connect(ctx, db.DSNFor("relay", "secret")+"&replication=database")
	if err != nil {
		t.Fatalf("replication connection: %v", err)
	}
	repl.Close(ctx)

	db.Exec(t, "SELECT pg_create_logical_replication_slot('drill', 'pgoutput')")
	port, pid := pg.Port(), pg.PostmasterPID(t)
	pg.StopImmediate(t)
	if _, err := pgx.Connect(ctx, db.DSN()); err == nil {
		t.Fatal("connected to a stopped cluster")
	}
	pg.Start(t)
	if pg.Port() != port {
		t.Fatalf("port changed across restart: %d -> %d", port, pg.Port())
	}
	if pg.PostmasterPID(t) == pid {
		t.Fatal("postmaster pid unchanged after StopImmediate+Start")
	}
	if n := db.QueryInt64(t, "SELECT count(*) FROM t"); n != 1 {
		t.Fatalf("rows after crash recovery = %d, want 1", n)
	}
	if !pg.SlotInfo(t, "app", "drill").Exists {
		t.Fatal("slot lost across crash")
	}
	pg.Restart(t)
	if got := db.QueryString(t, "SHOW wal_sender_timeout"); got != "10s" {
		t.Fatalf("settings lost across Restart: wal_sender_timeout = %q", got)
	}
	pg.Stop(t)
	pg.Start(t)
	db.Exec(t, "SELECT 1")

	// The harshest crash: the postmaster itself is SIGKILLed.
	pg.KillPostmaster(t)
	pg.Start(t)
	if n := db.QueryInt64(t, "SELECT count(*) FROM t"); n != 1 {
		t.Fatalf("rows after postmaster SIGKILL = %d, want 1", n)
	}
}

// startOwner runs TestHelperOrphanOwner in a child test binary and returns
// it with its cluster's data dir and postmaster pid.
func startOwner(t *testing.T) (owner *harness.Process, dataDir string, pid int) {
	t.Helper()
	owner = harness.StartProcess(t, os.Args[0],
		[]string{"-test.run=^TestHelperOrphanOwner$", "-test.v"},
		[]string{"HARNESS_ORPHAN_OWNER=1"})
	owner.WaitForOutput(t, "ORPHAN ", 2*time.Minute)
	for _, line := range strings.Split(owner.Output(), "\n") {
		if rest, ok := strings.CutPrefix(line, "ORPHAN "); ok {
			if _, err := fmt.Sscanf(rest, "%s %d", &dataDir, &pid); err != nil {
				t.Fatalf("parse %q: %v", line, err)
			}
		}
	}
	return owner, dataDir, pid
}

// waitClusterGone waits for the postmaster to exit and its directory to be
// deleted.
func waitClusterGone(t *testing.T, dataDir string, pid int) {
	t.Helper()
	harness.WaitFor(t, 10*time.Second, "postmaster to exit", func() bool {
		if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			return true
		}
		// Exited but not yet reaped by PID 1.
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		return err == nil && strings.Contains(string(stat), ") Z ")
	})
	if _, err := os.Stat(filepath.Dir(dataDir)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("cluster dir still there: %v", err)
	}
}

// TestOrphanedClusterIsReaped kills a test binary that owns a running
// cluster, as a test timeout or SIGKILL would, and checks that the next
// binary's Main stops that cluster and deletes its files.
func TestOrphanedClusterIsReaped(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two extra test binaries and a cluster")
	}
	owner, dataDir, pid := startOwner(t)
	owner.Kill()
	if code, _ := owner.Wait(time.Second); code != 128+int(syscall.SIGKILL) {
		t.Fatalf("owner exit code %d, want %d", code, 128+int(syscall.SIGKILL))
	}
	if syscall.Kill(pid, 0) != nil {
		t.Fatalf("postmaster %d died with its owner; nothing to reap", pid)
	}

	next := harness.StartProcess(t, os.Args[0], []string{"-test.run=^$"}, nil)
	if code, err := next.Wait(2 * time.Minute); err != nil || code != 0 {
		t.Fatalf("next test binary: code %d, err %v\n%s", code, err, next.Output())
	}
	waitClusterGone(t, dataDir, pid)
}

// TestSignalStopsClusters checks that SIGTERM to a test binary using Main
// stops the clusters it started before it exits.
func TestSignalStopsClusters(t *testing.T) {
	if testing.Short() {
		t.Skip("starts an extra test binary and a cluster")
	}
	owner, dataDir, pid := startOwner(t)
	if err := owner.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code, err := owner.Wait(time.Minute); err != nil || code != 1 {
		t.Fatalf("owner after SIGTERM: code %d err %v\n%s", code, err, owner.Output())
	}
	waitClusterGone(t, dataDir, pid)
}

// TestHelperOrphanOwner is the owner binary of TestOrphanedClusterIsReaped.
func TestHelperOrphanOwner(t *testing.T) {
	if os.Getenv("HARNESS_ORPHAN_OWNER") == "" {
		t.Skip("helper for TestOrphanedClusterIsReaped")
	}
	pg, _, err := harness.StartPostgresMain(harness.PGOptions{})
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("ORPHAN %s %d\n", pg.DataDir(), pg.PostmasterPID(t))
	// Bounded wait for the parent's SIGKILL; reaching the end is a failure.
	<-time.After(2 * time.Minute)
	t.Fatal("owner was not killed")
}

func TestKfakeProduceConsume(t *testing.T) {
	kf := harness.StartKfake(t)
	if len(kf.Brokers()) != 1 || kf.BrokerList() != kf.Brokers()[0] || !strings.HasPrefix(kf.BrokerList(), "127.0.0.1:") {
		t.Fatalf("brokers %v / %q", kf.Brokers(), kf.BrokerList())
	}
	cl := kf.Client(t)
	ctx := context.Background()
	var want []string
	for i := 0; i < 20; i++ {
		id := fmt.Sprintf("ev-%02d", i)
		want = append(want, id)
		rec := &kgo.Record{
			Topic: "outbox.orders",
			Key:   []byte(fmt.Sprintf("agg-%d", i%3)),
			Value: []byte(`{"n":` + strconv.Itoa(i) + `}`),
			Headers: []kgo.RecordHeader{
				{Key: "event_id", Value: []byte(id)},
				{Key: "aggregate_id", Value: []byte(fmt.Sprintf("agg-%d", i%3))},
			},
		}
		if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Fatalf("produce: %v", err)
		}
	}
	recs := harness.ConsumeEventIDs(t, kf.Brokers(), `^outbox\.`, want, 20*time.Second)
	if len(recs) != 20 {
		t.Fatalf("got %d records, want 20", len(recs))
	}
	r := recs[0]
	if r.Topic != "outbox.orders" || len(r.HeaderKeys) != 2 || r.HeaderKeys[0] != "event_id" || r.HeaderKeys[1] != "aggregate_id" || r.Timestamp.IsZero() {
		t.Fatalf("record not decoded as expected: %+v", r)
	}
	partitions := int32(len(harness.EndOffsets(t, kf.Brokers(), "outbox.orders")))
	commitOrder := map[string][]string{}
	for _, r := range recs {
		if p := harness.JavaPartition(r.Key, partitions); p != r.Partition {
			t.Errorf("%s: franz-go put key %q on partition %d, JavaPartition says %d", r.EventID(), r.Key, r.Partition, p)
		}
		agg := r.Headers["aggregate_id"]
		commitOrder[agg] = append(commitOrder[agg], r.EventID())
	}
	// Records of one aggregate went to one partition in produce order.
	for agg := range commitOrder {
		sort.Strings(commitOrder[agg])
	}
	harness.CheckPerAggregateOrder(t, recs, commitOrder)
	harness.CheckNoLoss(t, recs, want)

	// A topic created after the consumer started is picked up.
	done := make(chan error, 1)
	go func() {
		kf.CreateTopic(t, "outbox.late", 3, nil)
		done <- cl.ProduceSync(ctx, &kgo.Record{Topic: "outbox.late", Value: []byte("late")}).FirstErr()
	}()
	late := harness.ConsumeUntil(t, kf.Brokers(), `^outbox\.late$`, 20*time.Second, func(all []harness.Record) bool {
		return len(all) == 1
	})
	if err := <-done; err != nil {
		t.Fatalf("produce late: %v", err)
	}
	if string(late[0].Value) != "late" {
		t.Fatalf("late record %+v", late[0])
	}
}

func TestKfakeTopicConfigAndOptions(t *testing.T) {
	kf := harness.StartKfakeWith(t, harness.KfakeOptions{
		Brokers:           2,
		Partitions:        4,
		DisableAutoCreate: true,
		SeedTopics:        map[string]int32{"seeded": 0},
	})
	if len(kf.Brokers()) != 2 || !strings.Contains(kf.BrokerList(), ",") {
		t.Fatalf("brokers %v", kf.Brokers())
	}
	if n := len(harness.EndOffsets(t, kf.Brokers(), "seeded")); n != 4 {
		t.Fatalf("seeded topic has %d partitions, want the default 4", n)
	}
	kf.CreateTopic(t, "small", 1, map[string]string{"max.message.bytes": "1000"})
	cl := kf.Client(t, kgo.RecordRetries(1))
	ctx := context.Background()
	big := make([]byte, 2000)
	_, _ = rand.Read(big) // incompressible, so the batch stays over the limit
	err := cl.ProduceSync(ctx, &kgo.Record{Topic: "small", Value: big}).FirstErr()
	if !errors.Is(err, kerr.MessageTooLarge) {
		t.Fatalf("oversized record: err = %v, want MESSAGE_TOO_LARGE", err)
	}
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "small", Value: make([]byte, 100)}).FirstErr(); err != nil {
		t.Fatalf("small record: %v", err)
	}
	// Auto-creation is off: producing to an unknown topic must not create it.
	tctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := cl.ProduceSync(tctx, &kgo.Record{Topic: "unknown", Value: []byte("x")}).FirstErr(); err == nil {
		t.Fatal("produced to a topic that should not exist")
	}
}

func TestKfakeProduceFaults(t *testing.T) {
	kf := harness.StartKfake(t, kfake.DefaultNumPartitions(1))
	ctx := context.Background()
	// Fast metadata refresh: clients refresh before retrying most errors.
	cl := kf.Client(t, kgo.MetadataMinAge(10*time.Millisecond), kgo.RetryBackoffFn(func(int) time.Duration { return 10 * time.Millisecond }))
	produce := func(c *kgo.Client, topic, id string) error {
		return c.ProduceSync(ctx, &kgo.Record{Topic: topic, Value: []byte(id),
			Headers: []kgo.RecordHeader{{Key: "event_id", Value: []byte(id)}}}).FirstErr()
	}

	t.Run("retriable error is retried", func(t *testing.T) {
		f := kf.FailProduce(2, kerr.NotLeaderForPartition.Code)
		if err := produce(cl, "faults", "e1"); err != nil {
			t.Fatalf("produce: %v", err)
		}
		if f.Hits() != 2 {
			t.Fatalf("fault hits = %d, want 2", f.Hits())
		}
		if got := harness.EndOffsets(t, kf.Brokers(), "faults")[0]; got != 1 {
			t.Fatalf("end offset %d, want 1: failed requests must not append", got)
		}
	})

	t.Run("fatal error fails the record", func(t *testing.T) {
		f := kf.FailProduce(1, kerr.InvalidRecord.Code)
		if err := produce(cl, "faults", "e2"); !errors.Is(err, kerr.InvalidRecord) {
			t.Fatalf("err = %v, want INVALID_RECORD", err)
		}
		if err := produce(cl, "faults", "e3"); err != nil {
			t.Fatalf("produce after the fault ran out: %v", err)
		}
		if f.Hits() != 1 {
			t.Fatalf("hits = %d, want 1", f.Hits())
		}
	})

	t.Run("remove an unlimited fault", func(t *testing.T) {
		f := kf.FailProduce(-1, kerr.InvalidRecord.Code)
		if err := produce(cl, "faults", "e4"); !errors.Is(err, kerr.InvalidRecord) {
			t.Fatalf("err = %v, want INVALID_RECORD", err)
		}
		f.Remove()
		if err := produce(cl, "faults", "e5"); err != nil {
			t.Fatalf("produce after Remove: %v", err)
		}
	})

	t.Run("cut connection is retried", func(t *testing.T) {
		f := kf.CutProduce(1)
		if err := produce(cl, "faults", "e6"); err != nil {
			t.Fatalf("produce: %v", err)
		}
		if f.Hits() != 1 {
			t.Fatalf("hits = %d, want 1", f.Hits())
		}
	})

	t.Run("failure after append duplicates without idempotence", func(t *testing.T) {
		plain := kf.Client(t, kgo.DisableIdempotentWrite(), kgo.MetadataMinAge(10*time.Millisecond),
			kgo.RetryBackoffFn(func(int) time.Duration { return 10 * time.Millisecond }))
		f := kf.FailProduceAfterAppend(1)
		if err := produce(plain, "dups", "d1"); err != nil {
			t.Fatalf("produce: %v", err)
		}
		recs := harness.ConsumeUntil(t, kf.Brokers(), "^dups$", 10*time.Second, func(all []harness.Record) bool { return len(all) >= 2 })
		if f.Hits() != 1 || harness.Duplicates(recs)["d1"] != 2 {
			t.Fatalf("hits %d, duplicates %v", f.Hits(), harness.Duplicates(recs))
		}
		if firsts := harness.FirstDeliveries(recs); len(firsts) != 1 || firsts[0].Offset != 0 {
			t.Fatalf("first deliveries %+v", firsts)
		}
	})

	t.Run("hold and release", func(t *testing.T) {
		release := kf.HoldProduce()
		res := make(chan error, 1)
		cl.Produce(ctx, &kgo.Record{Topic: "faults", Value: []byte("held")}, func(_ *kgo.Record, err error) { res <- err })
		harness.WaitFor(t, 10*time.Second, "produce request to be held", func() bool { return kf.HeldProduces() == 1 })
		before := harness.EndOffsets(t, kf.Brokers(), "faults")[0] // other connections still served
		release()
		if err := <-res; err != nil {
			t.Fatalf("held produce: %v", err)
		}
		if kf.HeldProduces() != 0 {
			t.Fatalf("still holding %d", kf.HeldProduces())
		}
		if after := harness.EndOffsets(t, kf.Brokers(), "faults")[0]; after != before+1 {
			t.Fatalf("end offset %d -> %d, want one append after release", before, after)
		}
		release() // idempotent
	})

	t.Run("unreleased hold does not block cleanup", func(t *testing.T) {
		kf2 := harness.StartKfake(t)
		c2 := kf2.Client(t)
		kf2.HoldProduce()
		c2.Produce(ctx, &kgo.Record{Topic: "never", Value: []byte("x")}, nil)
		harness.WaitFor(t, 10*time.Second, "produce request to be held", func() bool { return kf2.HeldProduces() == 1 })
	})
}

// murmur2 is Kafka's Utils.murmur2, transcribed from the Java source with
// Java's int arithmetic, as an independent reference for JavaPartition.
func murmur2(data []byte) int32 {
	const seed, m, r = int32(-1756908916), int32(0x5bd1e995), 24 // seed is 0x9747b28c as a Java int
	length := int32(len(data))
	h := seed ^ length
	length4 := length / 4
	for i := int32(0); i < length4; i++ {
		i4 := i * 4
		k := int32(data[i4+0]) + int32(data[i4+1])<<8 + int32(data[i4+2])<<16 + int32(data[i4+3])<<24
		k *= m
		k ^= int32(uint32(k) >> r)
		k *= m
		h *= m
		h ^= k
	}
	switch length % 4 {
	case 3:
		h ^= int32(data[(length&^3)+2]) << 16
		fallthrough
	case 2:
		h ^= int32(data[(length&^3)+1]) << 8
		fallthrough
	case 1:
		h ^= int32(data[length&^3])
		h *= m
	}
	h ^= int32(uint32(h) >> 13)
	h *= m
	h ^= int32(uint32(h) >> 15)
	return h
}

func TestJavaPartition(t *testing.T) {
	// Kafka's UtilsTest.testMurmur2 vectors.
	golden := map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
	}
	const n = 1 << 30 // large enough that the modulo keeps the whole positive hash
	for key, hash := range golden {
		if got := murmur2([]byte(key)); got != hash {
			t.Errorf("reference murmur2(%q) = %d, want %d", key, got, hash)
		}
		if got, want := harness.JavaPartition([]byte(key), n), (hash&0x7fffffff)%n; got != want {
			t.Errorf("JavaPartition(%q, 2^30) = %d, want %d", key, got, want)
		}
	}
	if got := harness.JavaPartition([]byte("foobar"), 50); got != 16 {
		t.Errorf("JavaPartition(foobar, 50) = %d, want 16", got)
	}
	for i := 0; i < 2000; i++ {
		key := []byte(fmt.Sprintf("aggregate-%d-%x", i, i*7919))[:i%24]
		for _, parts := range []int32{1, 3, 7, 10, 12, 64} {
			if got, want := harness.JavaPartition(key, parts), (murmur2(key)&0x7fffffff)%parts; got != want {
				t.Fatalf("JavaPartition(%q, %d) = %d, reference says %d", key, parts, got, want)
			}
		}
	}
	if harness.JavaPartition(nil, 3) != -1 || harness.JavaPartition([]byte("k"), 0) != -1 {
		t.Error("nil key or no partitions must give -1")
	}
}

// recordingTB captures Errorf calls so the checkers' failure reports can be
// asserted on.
type recordingTB struct {
	testing.TB
	errs []string
}

func (r *recordingTB) Helper() {}
func (r *recordingTB) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func rec(topic string, p int32, off int64, id string) harness.Record {
	return harness.Record{Topic: topic, Partition: p, Offset: off, Headers: map[string]string{"event_id": id}}
}

func TestDeliveryChecks(t *testing.T) {
	order := map[string][]string{"A": {"a1", "a2", "a3"}, "B": {"b1", "b2"}}
	// Redeliveries after the first copies do not break order.
	good := []harness.Record{
		rec("t", 0, 0, "a1"), rec("t", 1, 0, "b1"), rec("t", 0, 1, "a2"),
		rec("t", 0, 2, "a1"), rec("t", 0, 3, "a2"), rec("t", 0, 4, "a3"), rec("t", 1, 1, "b2"),
	}
	rt := &recordingTB{TB: t}
	harness.CheckPerAggregateOrder(rt, good, order)
	harness.CheckNoLoss(rt, good, []string{"a1", "a2", "a3", "b1", "b2"})
	if len(rt.errs) != 0 {
		t.Fatalf("good delivery reported: %v", rt.errs)
	}
	if d := harness.Duplicates(good); len(d) != 2 || d["a1"] != 2 || d["a2"] != 2 {
		t.Fatalf("duplicates %v", d)
	}
	if f := harness.FirstDeliveries(good); len(f) != 5 || f[0].EventID() != "a1" || f[3].EventID() != "b1" {
		t.Fatalf("first deliveries %v", f)
	}

	bad := []harness.Record{
		rec("t", 0, 0, "a2"), rec("t", 0, 1, "a1"), rec("t", 0, 2, "a3"), // a2 overtook a1
		rec("t", 1, 0, "b1"), rec("t", 2, 0, "b2"), // B split over partitions
	}
	rt = &recordingTB{TB: t}
	harness.CheckPerAggregateOrder(rt, bad, order)
	harness.CheckNoLoss(rt, bad, []string{"a1", "a2", "a3", "b1", "b2", "c1"})
	want := []string{
		"aggregate A: event a2 (#2 in commit order) was first delivered at t/0@0, before event a1 (#1) at t/0@1",
		"aggregate B: event b2 (#2) went to t/2@0 but event b1 (#1) to t/1@0",
		"lost 1 of 6 events: c1",
	}
	if len(rt.errs) != len(want) {
		t.Fatalf("got reports %q, want %d", rt.errs, len(want))
	}
	for i, w := range want {
		if !strings.Contains(rt.errs[i], w) {
			t.Errorf("report %d = %q, want it to contain %q", i, rt.errs[i], w)
		}
	}
}

func TestProxy(t *testing.T) {
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { echo.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() { defer wg.Done(); _, _ = io.Copy(c, c); c.Close() }()
		}
	}()

	px := harness.StartProxy(t, echo.Addr().String())
	if px.Addr() != fmt.Sprintf("127.0.0.1:%d", px.Port()) {
		t.Fatalf("addr %q port %d", px.Addr(), px.Port())
	}
	roundTrip := func(c net.Conn, msg string) error {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			return err
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(c, buf); err != nil {
			return err
		}
		if string(buf) != msg {
			return fmt.Errorf("echoed %q, want %q", buf, msg)
		}
		return nil
	}
	c1, err := net.Dial("tcp", px.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close()
	if err := roundTrip(c1, "hello"); err != nil {
		t.Fatalf("through proxy: %v", err)
	}
	harness.WaitFor(t, 5*time.Second, "one proxied connection", func() bool { return px.Connections() == 1 })

	px.CutAll()
	if px.Connections() != 0 {
		t.Fatalf("connections after CutAll = %d", px.Connections())
	}
	if err := roundTrip(c1, "again"); err == nil {
		t.Fatal("cut connection still works")
	}

	px.Pause()
	c2, err := net.Dial("tcp", px.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(c2, "paused"); err == nil {
		t.Fatal("connection accepted while paused")
	}
	c2.Close()
	px.Resume()
	c3, err := net.Dial("tcp", px.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	if err := roundTrip(c3, "resumed"); err != nil {
		t.Fatalf("after Resume: %v", err)
	}
}

func TestProxyCutsPostgresSession(t *testing.T) {
	pg := sharedPG(t)
	db := pg.CreateTestDatabase(t)
	px := harness.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", pg.Port()))
	dsn := strings.Replace(db.DSN(), fmt.Sprintf(":%d/", pg.Port()), fmt.Sprintf(":%d/", px.Port()), 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("connect through proxy: %v", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("query through proxy: %v", err)
	}
	px.CutAll()
	if _, err := conn.Exec(ctx, "SELECT 1"); err == nil {
		t.Fatal("query on a cut session succeeded")
	}
}

func TestProcess(t *testing.T) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep binary")
	}
	p := harness.StartProcess(t, sleep, []string{"60"}, nil)
	if p.Exited() || p.Pid() <= 0 {
		t.Fatalf("exited=%v pid=%d right after start", p.Exited(), p.Pid())
	}
	if _, err := p.Wait(50 * time.Millisecond); err == nil {
		t.Fatal("Wait returned for a running process")
	}
	p.Kill()
	if !p.Exited() {
		t.Fatal("not exited after Kill")
	}
	if code, err := p.Wait(time.Second); err != nil || code != 137 {
		t.Fatalf("after Kill: code %d err %v, want 137", code, err)
	}
	p.Kill() // idempotent

	// The trap goes in before "ready", which is what the test waits for:
	// otherwise a loaded machine can deliver TERM before it is set.
	script := `trap 'echo stopping; exit 3' TERM; echo "ready $GREETING"; while :; do sleep 0.05; done`
	sh := harness.StartProcess(t, "/bin/sh", []string{"-c", script}, []string{"GREETING=hi"})
	sh.WaitForOutput(t, "ready hi", 10*time.Second)
	code, err := sh.Stop(10 * time.Second)
	if err != nil || code != 3 {
		t.Fatalf("Stop: code %d err %v, want 3", code, err)
	}
	if !strings.Contains(sh.Output(), "stopping") {
		t.Fatalf("output %q lacks the TERM trap's message", sh.Output())
	}

	stubborn := harness.StartProcess(t, "/bin/sh", []string{"-c", `trap '' TERM; echo up; while :; do sleep 0.05; done`}, nil)
	stubborn.WaitForOutput(t, "up", 10*time.Second)
	if code, err := stubborn.Stop(200 * time.Millisecond); err == nil || code != 137 {
		t.Fatalf("Stop of a TERM-ignoring process: code %d err %v, want 137 and an error", code, err)
	}
}

func TestBuildRelay(t *testing.T) {
	if _, err := os.Stat(filepath.Join("..", "..", "cmd", "outbox-relay")); err != nil {
		t.Skip("cmd/outbox-relay not present yet")
	}
	bin := harness.BuildRelay(t)
	st, err := os.Stat(bin)
	if err != nil || st.Mode()&0o111 == 0 {
		t.Fatalf("relay binary %s: %v %v", bin, err, st)
	}
	if again := harness.BuildRelay(t); again != bin {
		t.Fatalf("second build went to %s, want cached %s", again, bin)
	}
}

func TestWaitForAndFreePort(t *testing.T) {
	port := harness.FreePort(t)
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatalf("free port %d not bindable: %v", port, err)
	}
	ln.Close()
	start := time.Now()
	calls := 0
	harness.WaitFor(t, 5*time.Second, "third call", func() bool { calls++; return calls == 3 })
	if elapsed := time.Since(start); elapsed > 2*time.Second {
		t.Fatalf("WaitFor took %v for three polls", elapsed)
	}
}
