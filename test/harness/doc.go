// Package harness is the shared integration-test harness for outbox-relay:
// it starts the real things the relay talks to and observes the results
// independently of the relay's own code. The PostgreSQL clusters and kfake
// brokers themselves come from internal/throwaway, which the demo uses too
// without linking testing; the harness wraps them for tests.
//
//   - postgres.go: throwaway PostgreSQL clusters (wal_level=logical) on
//     127.0.0.1, run as the postgres OS user when the tests run as root,
//     with helpers for databases (one per test, with its slot dropped at
//     the end), connections, SQL, the current WAL position, replication
//     slot state and LSN comparison, stop/crash/restart drills, and a pgx
//     tracer that counts statements; standby.go: base backups and
//     streaming standbys.
//   - kfake.go: in-process Kafka clusters (franz-go's kfake) with produce
//     fault injection (fail, fail after append, cut, hold).
//   - consumer.go: an independent franz-go consumer, Kafka's Java key
//     partitioning, delivery checks (loss, duplicates, per-aggregate
//     order, header times), and a consumer group's committed offsets.
//   - process.go: building the relay binary (or another program of the
//     module) once, running it as a child process with captured output,
//     and Main and MainWithPostgres, the TestMain helpers.
//   - relay.go: the relay's command-line flags for a test (RelayFlags),
//     running migrate and other short commands, starting run until it
//     streams, its admin URL, peak RSS, and parsing its JSON log lines.
//   - env.go: Env, one test's world in the packages that run the relay
//     binary (its database and slot, a kfake, the binary, a ledger), with
//     the commands every such package runs (migrate, run until it
//     streams, consume and check what was committed); each package's env
//     embeds it.
//   - metrics.go: HTTP requests to the admin endpoint, and reading
//     /metrics the way Prometheus parses it.
//   - proxy.go: a TCP proxy to cut connections at will.
//   - outbox.go: the events tests write (NumberedEvent), committing them
//     the way a service does (or a batch job, in one large INSERT), and a
//     ledger of every committed event_id in commit order per aggregate.
//   - drill.go: drill sizes (reduced, or full with
//     OUTBOX_RELAY_DRILL_SIZE=full) and logged, replayable random seeds.
//   - apachekafka.go: real Apache Kafka brokers (KRaft) for tests that
//     must run against the real thing: options, the cluster type and one
//     shared cluster per package run; apachekafka_config.go writes node
//     configuration and formats storage; apachekafka_process.go starts,
//     stops, kills and restarts the JVMs; apachekafka_admin.go waits for
//     readiness and creates topics.
//   - tools.go: command-line tools a test needs (systemd-analyze,
//     promtool, dpkg), skipped loudly when missing unless the environment
//     requires them, and running them with a timeout.
//   - jaeger.go: a Jaeger all-in-one (in-memory, every endpoint on
//     127.0.0.1) that test/tracing/jaeger/fetch.sh builds, its OTLP
//     endpoints, and traces read from its query API.
//   - wait.go: WaitFor (poll a condition with a deadline, never sleep as
//     synchronisation) and FreePort.
//
// Every package using the harness should have
//
//	func TestMain(m *testing.M) { harness.Main(m) }
//
// or, when its tests share one cluster, MainWithPostgres.
//
// Main stops whatever the harness started that is still running when the
// tests end or the binary gets SIGINT/SIGTERM, and first reaps clusters
// orphaned by an earlier binary that was killed. A test panic is covered by
// t.Cleanup, which testing still runs; a test timeout kills the binary
// outright, and what it leaves behind is reaped by the next run. Resources
// living longer than one test register with local.OnClose, and temporary
// directories that must be reaped after a crash come from
// throwaway.MakeOwnedTempDir.
//
// Helpers taking a testing.TB fail the test with t.Fatalf and so must run
// on the test's goroutine.
package harness
