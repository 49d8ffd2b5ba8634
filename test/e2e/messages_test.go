package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// The messages source's own names, beside the table source's defaults.
const (
	messagesSlotSuffix  = "_msg"
	messagesPublication = "outbox_relay_messages"
	messagesTopicPrefix = "msg."
)

// messagesArgs are the flags of a messages-source command: its own slot
// and publication, so a table-source relay can run on the same database.
func (e *env) messagesArgs(cmd string, extra ...string) []string {
	own := []string{"--source", "messages", "--slot", e.Slot + messagesSlotSuffix, "--publication", messagesPublication}
	if cmd == "run" {
		own = append(own, "--topic", messagesTopicPrefix+"{aggregate_type}")
	}
	return e.Args(cmd, append(own, extra...)...)
}

// A service that writes each event both ways, as an outbox row and as a
// message, in one transaction, gets the same Kafka record from both
// sources: topic (up to the template's prefix), partition, key, value and
// every header, byte for byte. Read with the independent client.
func TestMessagesRecordsAreTheTableSourcesByteForByte(t *testing.T) {
	e := newEnv(t)
	e.Migrate()
	harness.Migrate(t, e.Bin, e.messagesArgs("migrate"))
	e.DropSlotAtEnd(t)
	e.StartRelay()
	harness.StartStreaming(t, e.Bin, e.messagesArgs("run"), harness.LogLevelInfo)

	writer, err := outbox.New("")
	if err != nil {
		t.Fatal(err)
	}
	emitter, err := outbox.NewEmitter("")
	if err != nil {
		t.Fatal(err)
	}
	conn := e.DB.Connect(t)
	ctx := context.Background()
	at := time.Date(2026, 12, 2, 9, 30, 15, 123456789, time.FixedZone("CET", 3600))
	var ids []string
	for i := range 60 {
		events := []outbox.Event{
			{AggregateType: "order", AggregateID: "o-" + string(rune('a'+i%7)), EventType: "Placed",
				Payload: []byte(`{"z": 1, "a": [1.50, "x\u00e9"],   "n": null, "big": 12345678901234567890}`)},
			{AggregateType: "customer", AggregateID: "c-1", EventType: "Renamed", SchemaVersion: 3,
				Payload: []byte(`"just a string"`), Headers: map[string]string{"tenant": "acme", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
				OccurredAt: at, AggregateVersion: int64(i + 1)},
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		written, err := writer.Write(ctx, tx, events...)
		if err != nil {
			t.Fatal(err)
		}
		for j := range events {
			events[j].ID = written[j]
		}
		emitted, err := emitter.Emit(ctx, tx, events...)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(written, emitted) {
			t.Fatalf("Emit returned %v for the IDs %v", emitted, written)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, written...)
	}
	fromTable := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^outbox\.event\.`, ids, time.Minute)
	fromMessages := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^msg\.`, ids, time.Minute)
	if len(fromTable) != len(ids) || len(fromMessages) != len(ids) {
		t.Fatalf("%d records from the table, %d from messages, for %d events", len(fromTable), len(fromMessages), len(ids))
	}
	byID := map[string]harness.Record{}
	for _, r := range fromTable {
		byID[r.EventID()] = r
	}
	for _, m := range fromMessages {
		r := byID[m.EventID()]
		if strings.TrimPrefix(m.Topic, messagesTopicPrefix) != strings.TrimPrefix(r.Topic, "outbox.event.") || m.Partition != r.Partition ||
			string(m.Key) != string(r.Key) || string(m.Value) != string(r.Value) ||
			!slices.Equal(m.HeaderKeys, r.HeaderKeys) || !slices.EqualFunc(m.HeaderValues, r.HeaderValues, func(a, b []byte) bool { return string(a) == string(b) }) {
			t.Fatalf("event %s differs:\nmessages: %s/%d key %q value %q headers %q %q\ntable:    %s/%d key %q value %q headers %q %q",
				m.EventID(), m.Topic, m.Partition, m.Key, m.Value, m.HeaderKeys, m.HeaderValues,
				r.Topic, r.Partition, r.Key, r.Value, r.HeaderKeys, r.HeaderValues)
		}
	}
}

// A message that is no outbox event is quarantined with the reason and its
// content, and the events after it keep flowing; messages that must never
// be published (rolled back, non-transactional, another prefix) are not,
// and are counted.
func TestMessagesThatAreNoEventsAreQuarantinedOrSkipped(t *testing.T) {
	e := newEnv(t)
	relay := e.startMessagesRelay(t)
	conn := e.DB.Connect(t)
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	exec(`SELECT pg_logical_emit_message(true, 'outbox', '{"event_id": "not-a-uuid", "aggregate_type": "order"}')`)
	exec(`SELECT pg_logical_emit_message(false, 'outbox', $1)`, validContent(harness.NewUUID()))
	exec(`SELECT pg_logical_emit_message(true, 'someone-else', $1)`, validContent(harness.NewUUID()))
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rolledBack := harness.NewUUID()
	if _, err := tx.Exec(ctx, `SELECT pg_logical_emit_message(true, 'outbox', $1)`, validContent(rolledBack)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	good := harness.NewUUID()
	exec(`SELECT pg_logical_emit_message(true, 'outbox', $1)`, validContent(good))

	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^msg\.`, []string{good}, time.Minute)
	if len(records) != 1 {
		t.Fatalf("published %d records, want only event %s: %v", len(records), good, records)
	}
	var reason, payload string
	if err := conn.QueryRow(ctx, "SELECT error_message, payload::text FROM outbox_quarantine").Scan(&reason, &payload); err != nil {
		t.Fatalf("the bad message is not in the quarantine table: %v", err)
	}
	for _, want := range []string{`event_id "not-a-uuid" is not a UUID`, "no aggregate_id, event_type, payload", "WAL position"} {
		if !strings.Contains(reason, want) {
			t.Errorf("quarantine reason %q does not say %q", reason, want)
		}
	}
	if !strings.Contains(payload, "not-a-uuid") {
		t.Errorf("quarantined payload %s does not keep the message's content", payload)
	}
	if code, out := harness.RunCommand(t, e.Bin, e.messagesArgs("status")); code != 0 || !strings.Contains(out, e.Slot+messagesSlotSuffix) {
		t.Errorf("status --source messages: exit %d:\n%s", code, out)
	}
	url := relay.AdminURL(t)
	harness.WaitFor(t, 30*time.Second, "the skipped messages are counted", func() bool {
		return harness.Metric(t, url, "outbox_relay_messages_skipped_total", "reason", "non_transactional") == 1 &&
			harness.Metric(t, url, "outbox_relay_messages_skipped_total", "reason", "other_prefix") == 1
	})
}

// validContent is a message content of one valid event.
func validContent(id string) string {
	return `{"event_id": "` + id + `", "aggregate_type": "order", "aggregate_id": "o-1", "event_type": "Placed", "payload": {"ok": true}}`
}

// What needs an outbox table is refused in this mode at start-up, with
// exit 2 and a line that says why.
func TestMessagesSourceRefusesWhatNeedsATable(t *testing.T) {
	e := newEnv(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{e.messagesArgs("run", "--retention", "24h"), "--retention 24h0m0s with --source messages"},
		{e.messagesArgs("run", "--reconcile-every", "1m"), "--reconcile-every with --source messages"},
		{e.messagesArgs("run", "--outbox-layout", "debezium"), "--outbox-layout and the column flags with --source messages"},
		{append([]string{"reconcile", "--source", "messages"}, e.Args("")[1:]...), "reconcile compares the outbox table with Kafka"},
		{e.Args("run", "--source", "messages", "--message-prefix", ""), "--message-prefix"},
		{e.messagesArgs("run", "--max-message-bytes", "1000"), "--max-message-bytes 1000: below --kafka-max-message-bytes 1000000"},
	} {
		code, out := harness.RunCommand(t, e.Bin, c.args)
		if code != 2 || !strings.Contains(out, c.want) {
			t.Errorf("%v: exit %d, want 2 and %q:\n%s", c.args, code, c.want, out)
		}
	}
}

// DropSlotAtEnd drops the messages source's slot when the test ends.
func (e *env) DropSlotAtEnd(t *testing.T) { e.DB.DropSlotAtEnd(t, e.Slot+messagesSlotSuffix) }

// startMessagesRelay migrates for the messages source and starts its relay
// alone, streaming, its slot dropped when the test ends.
func (e *env) startMessagesRelay(t *testing.T) *harness.Process {
	harness.Migrate(t, e.Bin, e.messagesArgs("migrate"))
	e.DropSlotAtEnd(t)
	return harness.StartStreaming(t, e.Bin, e.messagesArgs("run"), harness.LogLevelInfo)
}

// Issue 40.3: a 150 MB message peaked at 613 MB in the relay (the default
// GOMEMLIMIT is 192 MB), and a 300 MB one was OOM-killed under the shipped
// unit's 1 GiB. A message over --max-message-bytes (default 64 MiB) is
// dropped unread as it streams by and quarantined by reference, with its
// WAL position, size and SHA-256, while the relay's peak stays small; the
// events around it go on. CI sends 120 MB; OUTBOX_RELAY_DRILL_SIZE=full
// sends 1,000,000,000 bytes, near PostgreSQL's largest message.
func TestLargeMessageIsQuarantinedByReferenceWithBoundedMemory(t *testing.T) {
	e := newEnv(t)
	relay := e.startMessagesRelay(t)
	conn := e.DB.Connect(t)
	ctx := context.Background()
	before, after, big := harness.NewUUID(), harness.NewUUID(), harness.NewUUID()
	filler := harness.Sized(120<<20, 1_000_000_000)
	head := `{"event_id": "` + big + `", "aggregate_type": "order", "aggregate_id": "o-1", "event_type": "Big", "payload": {"s": "`
	tail := `"}}`
	for _, sql := range []string{
		`SELECT pg_logical_emit_message(true, 'outbox', '` + validContent(before) + `')`,
		`SELECT pg_logical_emit_message(true, 'outbox', '` + head + `' || repeat('x', ` + strconv.Itoa(filler) + `) || '` + tail + `')`,
		`SELECT pg_logical_emit_message(true, 'outbox', '` + validContent(after) + `')`,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^msg\.`, []string{before, after}, 5*time.Minute)
	harness.CheckNoLoss(t, records, []string{before, after})

	digest := sha256.New()
	digest.Write([]byte(head))
	digest.Write(bytes.Repeat([]byte("x"), filler))
	digest.Write([]byte(tail))
	var reason string
	harness.WaitFor(t, time.Minute, "the large message in the quarantine table", func() bool {
		return conn.QueryRow(ctx, "SELECT error_message FROM outbox_quarantine").Scan(&reason) == nil
	})
	size := strconv.Itoa(len(head) + filler + len(tail))
	for _, want := range []string{size + " bytes, over --max-message-bytes 67108864", "sha256 " + hex.EncodeToString(digest.Sum(nil)), "WAL position"} {
		if !strings.Contains(reason, want) {
			t.Errorf("quarantine reason %q does not say %q", reason, want)
		}
	}
	var rawSize int64
	var rawDigest string
	var rawKept bool
	if err := conn.QueryRow(ctx, "SELECT raw_size, encode(raw_sha256, 'hex'), raw IS NOT NULL FROM outbox_quarantine").Scan(&rawSize, &rawDigest, &rawKept); err != nil {
		t.Fatal(err)
	}
	if strconv.FormatInt(rawSize, 10) != size || rawDigest != hex.EncodeToString(digest.Sum(nil)) || rawKept {
		t.Errorf("quarantine row: raw_size %d, raw_sha256 %s, raw kept %v; want the reference alone", rawSize, rawDigest, rawKept)
	}
	peak, err := harness.PeakRSS(relay.Pid())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("a %s-byte message quarantined by reference; relay peak RSS %d MiB", size, peak>>20)
	if peak > 128<<20 {
		t.Errorf("relay peak RSS %d MiB with a %s-byte message: the message was held in memory", peak>>20, size)
	}
}

// Issue 40.2 and 40.10: a message whose content PostgreSQL cannot store as
// text (U+0000 escaped in the payload, U+0000 in aggregate_type, which
// also makes an invalid topic) failed the quarantine write and stopped the
// relay at every start, blaming the role's grants; a content with invalid
// base64 was replayed as the whole content in a JSON string. Now each is
// quarantined with its raw content and the stream goes on; replay refuses
// each such row, naming its problem, and sends the others; once the
// operator fixed a row and cleared content_problem, replay publishes a
// valid event, with the commit time as occurred_at.
func TestMessagesBadContentsAreKeptAndReplayedOnlyOnceFixed(t *testing.T) {
	e := newEnv(t)
	relay := e.startMessagesRelay(t)
	conn := e.DB.Connect(t)
	ctx := context.Background()
	emit := func(content string) {
		t.Helper()
		if _, err := conn.Exec(ctx, `SELECT pg_logical_emit_message(true, 'outbox', $1::text)`, content); err != nil {
			t.Fatal(err)
		}
	}
	nulAgg, badBase64 := harness.NewUUID(), harness.NewUUID()
	emit(`{"event_id":"nope","aggregate_type":"order","aggregate_id":"o-1","event_type":"Placed","payload":{"s":"a\u0000b"}}`)
	emit(`{"event_id":"` + nulAgg + `","aggregate_type":"or\u0000der","aggregate_id":"o-1","event_type":"Placed","payload":{}}`)
	emit(`{"event_id":"` + badBase64 + `","aggregate_type":"order","aggregate_id":"o-1","event_type":"Placed","payload_base64":"not base64!"}`)
	good := harness.NewUUID()
	emit(validContent(good))

	harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^msg\.`, []string{good}, time.Minute)
	if relay.Exited() {
		t.Fatalf("the relay exited:\n%s", relay.Output())
	}
	harness.WaitFor(t, 30*time.Second, "three rows in the quarantine table", func() bool {
		return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine") == 3
	})
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE content_problem IS NOT NULL AND raw IS NOT NULL AND raw_sha256 IS NOT NULL AND occurred_at IS NOT NULL"); n != 3 {
		t.Fatalf("%d rows with content_problem, raw, its digest and occurred_at, want 3", n)
	}
	if raw := e.DB.QueryString(t, "SELECT convert_from(raw, 'UTF8') FROM outbox_quarantine WHERE event_id = $1", nulAgg); !strings.Contains(raw, `"or\u0000der"`) {
		t.Errorf("raw %q is not the content as emitted", raw)
	}

	// list marks the rows replay refuses; --json carries raw and its digest.
	if code, out := harness.RunCommand(t, e.Bin, append([]string{"quarantine"}, e.Args("list")...)); code != 0 ||
		strings.Count(out, "[replay refuses: content_problem] [raw: ") != 3 {
		t.Errorf("quarantine list: exit %d, want each row marked with its raw size and digest:\n%s", code, out)
	}
	code, out := harness.RunCommand(t, e.Bin, append([]string{"quarantine"}, e.Args("list", "--json")...))
	var listed []map[string]any
	if err := json.Unmarshal([]byte(out), &listed); code != 0 || err != nil || len(listed) != 3 {
		t.Fatalf("quarantine list --json: exit %d, %v:\n%s", code, err, out)
	}
	for _, row := range listed {
		raw, _ := base64.StdEncoding.DecodeString(fmt.Sprint(row["raw"]))
		sum := sha256.Sum256(raw)
		if len(raw) == 0 || row["raw_sha256"] != hex.EncodeToString(sum[:]) || row["raw_size"] != float64(len(raw)) || row["content_problem"] == nil || row["raw_lsn"] == nil {
			t.Errorf("quarantine list --json row: %v", row)
		}
	}

	replay := func(args ...string) (int, string) {
		return harness.RunCommand(t, e.Bin, append([]string{"quarantine"},
			e.Args("replay", append(args, "--kafka-brokers", e.Kafka.BrokerList(), "--topic", messagesTopicPrefix+"{aggregate_type}")...)...))
	}
	code, out = replay("--all")
	if code != 1 || strings.Count(out, "REFUSED   ") != 3 || !strings.Contains(out, "(3 of them refused") ||
		!strings.Contains(out, "payload_base64 is not base64") || !strings.Contains(out, "aggregate_type (Go-quoted)") ||
		!strings.Contains(out, "unsupported Unicode escape sequence") || strings.Contains(out, "REPLAYED") {
		t.Fatalf("replay --all of three bad rows: exit %d, want 1 and each refused, naming its problem:\n%s", code, out)
	}
	if _, found := harness.TopicRecords(t, e.Kafka.Brokers(), "msg.order"); found != 1 {
		t.Fatalf("msg.order holds %d records after refused replays, want 1 (the good event)", found)
	}

	// The fix the docs give, then a replay of that row alone.
	e.DB.Exec(t, `UPDATE outbox_quarantine SET payload = '{"fixed": true}', payload_bytes = NULL, content_problem = NULL WHERE event_id = $1`, badBase64)
	e.DB.Exec(t, `UPDATE outbox_quarantine SET aggregate_type = 'order', content_problem = NULL WHERE event_id = $1`, nulAgg)
	if code, out := replay(badBase64, nulAgg); code != 0 || strings.Count(out, "REPLAYED  ") != 2 {
		t.Fatalf("replay of the fixed rows: exit %d:\n%s", code, out)
	}
	records := harness.ConsumeEventIDs(t, e.Kafka.Brokers(), `^msg\.`, []string{good, badBase64, nulAgg}, time.Minute)
	for _, r := range records {
		if r.EventID() == badBase64 && (string(r.Value) != `{"fixed": true}` || r.Headers["occurred_at"] == "") {
			t.Errorf("replayed event: value %q, occurred_at %q; want the fixed payload and the commit time", r.Value, r.Headers["occurred_at"])
		}
	}
	if relay.Exited() {
		t.Fatalf("the relay exited:\n%s", relay.Output())
	}
}
