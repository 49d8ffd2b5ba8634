package e2e

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// randomText is incompressible, so compression cannot bring a record under
// a size limit.
func randomText(n int) string {
	b := make([]byte, n/2)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// An event larger than its topic's max.message.bytes is caught before it
// is sent, quarantined whole, and the events after it keep flowing. After
// the limit is raised, replay delivers it with its original identity, to
// the topic run routes it to: the relay runs with a --topic of its own,
// and replay takes the same one (before, replay had no --topic and sent
// every event to the default template's topic, where no consumer of this
// relay reads).
func TestOversizeEventIsQuarantinedThenReplayed(t *testing.T) {
	e := newEnv(t)
	const topic = "shop.{aggregate_type}"
	e.Kafka.CreateTopic(t, "shop.order", partitions, map[string]string{"max.message.bytes": "4000"})
	e.Migrate()
	e.StartRelay("--topic", topic)
	conn := e.DB.Connect(t)
	ctx := context.Background()
	if err := e.Commit(ctx, conn, []harness.OutboxEvent{{AggregateType: "order", AggregateID: "o-1", EventType: "Small", Payload: `{"n": 1}`}}); err != nil {
		t.Fatal(err)
	}
	big := fmt.Sprintf(`{"blob": %q}`, randomText(10000))
	if err := e.Commit(ctx, conn, []harness.OutboxEvent{{AggregateType: "order", AggregateID: "o-1", EventType: "Huge", Payload: big, Headers: `{"tenant": "acme"}`}}); err != nil {
		t.Fatal(err)
	}
	ids, _ := e.Committed()
	bigID := ids[1]
	if err := e.Commit(ctx, conn, []harness.OutboxEvent{{AggregateType: "order", AggregateID: "o-1", EventType: "Small", Payload: `{"n": 3}`}}); err != nil {
		t.Fatal(err)
	}
	afterAll := e.DB.CurrentLSN(t)
	ids, _ = e.Committed()
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^shop\.`, []string{ids[0], ids[2]}, time.Minute)
	harness.WaitFor(t, 30*time.Second, "slot passes the quarantined event", func() bool {
		return harness.LSNAtMost(afterAll, e.ConfirmedFlush())
	})

	list := harness.StartProcess(t, e.Bin, append([]string{"quarantine", "list", "--json"}, e.Args("")[1:]...), nil)
	if code, err := list.Wait(time.Minute); err != nil || code != 0 {
		t.Fatalf("quarantine list exited %d (%v): %s", code, err, list.Output())
	}
	// The JSON keys are snake_case, like /slot's.
	var listed []struct {
		EventID      string `json:"event_id"`
		Topic        string `json:"topic"`
		ErrorClass   string `json:"error_class"`
		ErrorMessage string `json:"error_message"`
		Payload      string `json:"payload"`
		Headers      string `json:"headers"`
		Attempts     int    `json:"attempts"`
	}
	out := list.Output()
	if err := json.Unmarshal([]byte(out[strings.Index(out, "["):]), &listed); err != nil {
		t.Fatalf("quarantine list output: %v\n%s", err, out)
	}
	if len(listed) != 1 || listed[0].EventID != bigID || listed[0].ErrorClass != "permanent" ||
		!strings.Contains(listed[0].ErrorMessage, "max.message.bytes") || !strings.Contains(listed[0].Headers, "acme") ||
		listed[0].Topic != "shop.order" || len(listed[0].Payload) < 10000 {
		t.Fatalf("quarantine holds %+v, want the oversize event %s", listed, bigID)
	}

	adm := kadm.NewClient(e.Kafka.Client(t))
	limit := "1048588"
	resp, err := adm.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: "max.message.bytes", Value: &limit}}, "shop.order")
	if err == nil {
		_, err = resp.On("shop.order", nil)
	}
	if err != nil {
		t.Fatalf("raise max.message.bytes: %v", err)
	}
	replay := harness.StartProcess(t, e.Bin, append([]string{"quarantine", "replay", "--all", "--kafka-brokers", e.Kafka.BrokerList(), "--topic", topic}, e.Args("")[1:]...), nil)
	if code, err := replay.Wait(2 * time.Minute); err != nil || code != 0 {
		t.Fatalf("quarantine replay exited %d (%v): %s", code, err, replay.Output())
	}
	if out := replay.Output(); !strings.Contains(out, "REPLAYED  "+bigID+" to shop.order\n") {
		t.Errorf("replay's output does not say the event went to shop.order, the topic it was quarantined from:\n%s", out)
	}
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^shop\.`, []string{bigID}, time.Minute)
	for _, r := range records {
		if r.EventID() == bigID && (string(r.Key) != "o-1" || r.Headers["tenant"] != "acme" || r.Headers["event_type"] != "Huge") {
			t.Fatalf("replayed record has key %q headers %v", r.Key, r.Headers)
		}
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE replayed_at IS NULL"); n != 0 {
		t.Fatalf("%d events still waiting for a replay after a successful one", n)
	}
	if replayed := e.DB.QueryString(t, "SELECT replayed_topic FROM outbox_quarantine WHERE event_id = $1", bigID); replayed != "shop.order" {
		t.Fatalf("the replayed event is recorded as delivered to %q, want shop.order", replayed)
	}
}

// Retriable errors never quarantine: they are retried, in order, until the
// broker recovers.
func TestRetriableErrorsQuarantineNothing(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	e.StartRelay("--kafka-retry-backoff-max", "50ms")
	if err := e.writeEvents(e.DB.Connect(t), 3, 2, 2); err != nil {
		t.Fatal(err)
	}
	e.ConsumeAll(time.Minute)
	fault := e.Kafka.FailProduce(15, kerr.NotLeaderForPartition.Code)
	defer fault.Remove()
	if err := e.writeEvents(e.DB.Connect(t), 10, 2, 4); err != nil {
		t.Fatal(err)
	}
	e.ConsumeAll(2 * time.Minute)
	if fault.Hits() < 15 {
		t.Fatalf("only %d of 15 injected errors were hit", fault.Hits())
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine"); n != 0 {
		t.Fatalf("%d events quarantined after retriable errors", n)
	}
}

// Cleanup deletes published rows, but never one whose event is not yet
// confirmed: here the broker holds the acks of the second batch.
func TestRetentionNeverDeletesUnconfirmedRows(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	admin := e.StartRelay("--retention", "1ms", "--retention-margin", "0s", "--retention-interval", "100ms").AdminURL(t)
	conn := e.DB.Connect(t)
	if err := e.writeEvents(conn, 5, 2, 2); err != nil {
		t.Fatal(err)
	}
	e.ConsumeAll(time.Minute)
	harness.WaitFor(t, 30*time.Second, "cleanup deletes the published rows", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events") == 0
	})

	release := e.Kafka.HoldProduce()
	defer release()
	if err := e.writeEvents(conn, 3, 2, 1); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 30*time.Second, "the held events reach the broker", func() bool { return e.Kafka.HeldProduces() > 0 })
	runs := retentionRuns(t, admin)
	harness.WaitFor(t, 30*time.Second, "three more cleanup passes", func() bool { return retentionRuns(t, admin) >= runs+3 })
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events"); n != 6 {
		t.Fatalf("%d of 6 unconfirmed rows left after cleanup passes: cleanup deleted unconfirmed rows", n)
	}
	release()
	e.ConsumeAll(time.Minute)
	harness.WaitFor(t, 30*time.Second, "cleanup deletes the rows once confirmed", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events") == 0
	})
}

func retentionRuns(t *testing.T, admin string) float64 {
	t.Helper()
	return harness.Metric(t, admin, "outbox_relay_retention_runs_total")
}

// Issue 24.15: once a topic with a small max.message.bytes lowered the
// replay's producer limit, a later refusal quoted that lowered value as
// "--kafka-max-message-bytes", which the operator never gave. The error
// quotes the flag as given, says what lowered the limit, and advises
// replaying the event on its own, which then delivers it.
func TestReplayErrorQuotesTheGivenMaxMessageBytes(t *testing.T) {
	e := newEnv(t)
	e.Kafka.CreateTopic(t, "outbox.event.small", partitions, map[string]string{"max.message.bytes": "2000"})
	e.Kafka.CreateTopic(t, "outbox.event.big", partitions, nil)
	e.Migrate("--skip-slot")
	small, big := harness.NewUUID(), harness.NewUUID()
	// The small topic's event comes first, so its limit lowers the producer's.
	e.DB.Exec(t, `INSERT INTO outbox_quarantine (event_id, aggregate_type, aggregate_id, event_type, payload, topic,
		error_class, error_message, first_failed_at) VALUES
		($1, 'small', 's-1', 'Happened', '{"n": 1}', 'outbox.event.small', 'permanent', 'test', now() - interval '1 minute'),
		($2, 'big', 'b-1', 'Happened', jsonb_build_object('blob', $3::text), 'outbox.event.big', 'permanent', 'test', now())`,
		small, big, randomText(5000))
	code, out := harness.RunCommand(t, e.Bin, append([]string{"quarantine"},
		e.Args("replay", "--all", "--kafka-brokers", e.Kafka.BrokerList(), "--kafka-max-message-bytes", "1000000")...))
	if code != 1 || !strings.Contains(out, "REPLAYED  "+small) || !strings.Contains(out, "FAILED    "+big) {
		t.Fatalf("replay exited %d, want 1 with %s replayed and %s failed:\n%s", code, small, big, out)
	}
	if !strings.Contains(out, "--kafka-max-message-bytes 1000000, lowered to ") || strings.Count(out, "replay it on its own") != 1 {
		t.Fatalf("the refusal does not quote --kafka-max-message-bytes as given (1000000) and the lowered limit, and advise once to replay it on its own:\n%s", out)
	}
	// As the advice says, replayed on its own it goes through.
	code, out = harness.RunCommand(t, e.Bin, append([]string{"quarantine"},
		e.Args("replay", big, "--kafka-brokers", e.Kafka.BrokerList(), "--kafka-max-message-bytes", "1000000")...))
	if code != 0 || !strings.Contains(out, "REPLAYED  "+big) {
		t.Fatalf("replaying the big event on its own exited %d, want 0:\n%s", code, out)
	}
	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, []string{small, big}, time.Minute)
}

// Issue 24.15: `quarantine list --json` mixed time formats: occurred_at in
// PostgreSQL's text form ("2026-12-01 12:30:00+05:30"), the failure times
// in the command's local zone. Every time is RFC 3339 in UTC, whatever the
// host's time zone.
func TestQuarantineListJSONTimesAreUTC(t *testing.T) {
	e := newEnv(t)
	e.Migrate("--skip-slot")
	id := harness.NewUUID()
	e.DB.Exec(t, `INSERT INTO outbox_quarantine (event_id, aggregate_type, aggregate_id, event_type, payload, occurred_at,
		topic, error_class, error_message) VALUES ($1, 'order', 'o-1', 'Happened', '{}', '2026-12-01 12:30:00.25+05:30',
		'outbox.event.order', 'permanent', 'test')`, id)
	code, out := harness.RunCommand(t, e.Bin, append([]string{"quarantine"}, e.Args("list", "--json")...),
		"TZ=Asia/Kolkata")
	if code != 0 {
		t.Fatalf("quarantine list exited %d:\n%s", code, out)
	}
	var listed []map[string]any
	if err := json.Unmarshal([]byte(out[strings.Index(out, "["):]), &listed); err != nil || len(listed) != 1 {
		t.Fatalf("quarantine list --json: %v\n%s", err, out)
	}
	rfc3339UTC := regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$`)
	for _, field := range []string{"occurred_at", "first_failed_at", "last_failed_at"} {
		if v, _ := listed[0][field].(string); !rfc3339UTC.MatchString(v) {
			t.Errorf("%s is %q, want RFC 3339 in UTC", field, v)
		}
	}
	if got := listed[0]["occurred_at"]; got != "2026-12-01T07:00:00.25Z" {
		t.Errorf("occurred_at is %v, want 2026-12-01T07:00:00.25Z", got)
	}
}

// Issue 40.3, the table source: a 200 MB jsonb row peaked at 788 MiB in the
// relay, close to the shipped unit's 1 GiB (jsonb stops near 256 MB). A row
// over --max-message-bytes (default 64 MiB) has its large values dropped
// unread as they stream by; the event is quarantined by reference (the
// column, its size and SHA-256) and stays in the outbox table, and the rows
// after it go on. CI writes 120 MB; OUTBOX_RELAY_DRILL_SIZE=full 250 MB.
func TestLargeRowIsQuarantinedByReferenceWithBoundedMemory(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	relay := e.StartRelay()
	conn := e.DB.Connect(t)
	ctx := context.Background()
	filler := harness.Sized(120<<20, 250<<20)
	before, big, after := harness.NewUUID(), harness.NewUUID(), harness.NewUUID()
	if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES
		($1, 'order', 'o-1', 'Small', '{}'),
		($2, 'order', 'o-1', 'Big', jsonb_build_object('s', repeat('x', $4::int))),
		($3, 'order', 'o-1', 'Small', '{}')`, before, big, after, filler); err != nil {
		t.Fatal(err)
	}
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.order$`, []string{before, after}, 5*time.Minute)
	harness.CheckNoLoss(t, records, []string{before, after})

	payload := `{"s": "` + strings.Repeat("x", filler) + `"}` // jsonb's text form
	digest := sha256.Sum256([]byte(payload))
	var reason, rawDigest string
	var rawSize int64
	harness.WaitFor(t, time.Minute, "the large row in the quarantine table", func() bool {
		return conn.QueryRow(ctx, "SELECT error_message, raw_size, encode(raw_sha256, 'hex') FROM outbox_quarantine WHERE event_id = $1", big).
			Scan(&reason, &rawSize, &rawDigest) == nil
	})
	for _, want := range []string{fmt.Sprintf("column payload (%d bytes, sha256 %x) over --max-message-bytes 67108864", len(payload), digest), "stays in the outbox table", "reconcile --republish"} {
		if !strings.Contains(reason, want) {
			t.Errorf("quarantine reason %q does not say %q", reason, want)
		}
	}
	if rawSize != int64(len(payload)) || rawDigest != hex.EncodeToString(digest[:]) {
		t.Errorf("raw_size %d, raw_sha256 %s: want the dropped column's", rawSize, rawDigest)
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_events WHERE event_id = $1", big); n != 1 {
		t.Errorf("the large row is gone from the outbox table")
	}
	peak, err := harness.PeakRSS(relay.Pid())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("a %d-byte row quarantined by reference; relay peak RSS %d MiB", len(payload), peak>>20)
	if peak > 128<<20 {
		t.Errorf("relay peak RSS %d MiB with a %d-byte row: the row was held in memory", peak>>20, len(payload))
	}
}
