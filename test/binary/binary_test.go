// Package binary_test runs the relay binary on binary payloads (an outbox
// table whose payload column is bytea, from the wal and poll sources, and
// messages with payload_base64) against a private PostgreSQL and kfake,
// and reads every record back with franz-go:
// a marshalled Protobuf message and bytes that are no UTF-8 must arrive
// byte for byte, with --content-type's header, and so must one that Kafka
// refused, after the quarantine kept it and replay sent it again. In the
// CloudEvents formats the official SDK, not the relay's code, decodes the
// records.
package binary_test

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2/event"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// cluster is the PostgreSQL cluster the package's tests share; each test
// gets its own database, and so its own slot.
var cluster *harness.Postgres

func TestMain(m *testing.M) {
	harness.MainWithPostgres(m, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "20s"}},
		func(pg *harness.Postgres) { cluster = pg })
}

const contentType = "application/x-protobuf"

// written is one event the test writes and expects back.
type written struct {
	id, aggregateType, aggregateID string
	payload                        []byte
}

// messages are Protobuf messages as a service would marshal its events:
// a Struct, a Timestamp, and bytes that are no UTF-8.
func messages(t *testing.T) []proto.Message {
	t.Helper()
	st, err := structpb.NewStruct(map[string]any{"order": "o-1", "amount": 12.5, "lines": []any{"a", "b"}, "note": "caf\u00e9"})
	if err != nil {
		t.Fatal(err)
	}
	return []proto.Message{st, timestamppb.New(time.Date(2026, 12, 2, 10, 30, 15, 123456789, time.UTC)),
		wrapperspb.Bytes([]byte{0xff, 0x00, 0xc3})}
}

func marshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// payloads are the messages marshalled, then bytes no text column could
// hold: NUL, a lone continuation byte, 0xff, and what looks like bytea's
// own text form; an empty payload; a long run of a lead byte.
func payloads(t *testing.T) [][]byte {
	t.Helper()
	var out [][]byte
	for _, m := range messages(t) {
		out = append(out, marshal(t, m))
	}
	return append(out, []byte{0x00, 0x80, 0xff, 0xfe, '\\', 'x', '0', '0'}, []byte{}, bytes.Repeat([]byte{0xc3}, 300))
}

// setUp migrates, and for the table sources turns the payload column of
// the relay's own table into a bytea, as a team sending Protobuf would.
func setUp(t *testing.T, e *harness.Env) {
	t.Helper()
	e.Migrate()
	if e.Source != "messages" {
		e.DB.Exec(t, "ALTER TABLE outbox_events ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8')")
	}
}

// insertSQL writes one event as an outbox row, for the wal and poll
// sources.
const insertSQL = `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
	VALUES ($1, $2, $3, 'com.example.Happened', $4)`

// emitSQL writes one event as a logical decoding message, for the messages
// source, its payload base64 in payload_base64.
const emitSQL = `SELECT pg_logical_emit_message(true, 'outbox', jsonb_build_object(
	'event_id', $1::uuid, 'aggregate_type', $2::text, 'aggregate_id', $3::text, 'event_type', 'com.example.Happened',
	'payload_base64', encode($4::bytea, 'base64'))::text)`

func write(t *testing.T, e *harness.Env, evs []written) {
	t.Helper()
	sql := insertSQL
	if e.Source == "messages" {
		sql = emitSQL
	}
	conn := e.DB.Connect(t)
	for _, w := range evs {
		if _, err := conn.Exec(context.Background(), sql, w.id, w.aggregateType, w.aggregateID, w.payload); err != nil {
			t.Fatal(err)
		}
	}
}

func events(t *testing.T, aggregateTypes ...string) []written {
	var out []written
	for i, p := range payloads(t) {
		out = append(out, written{id: harness.NewUUID(), aggregateType: aggregateTypes[i%len(aggregateTypes)], aggregateID: fmt.Sprintf("agg-%d", i%3), payload: p})
	}
	return out
}

// consume reads the topics until a record of every written event is
// there, compares each with what was written, byte for byte, and returns
// them by event id.
func consume(t *testing.T, brokers []string, topicRegex string, evs []written) map[string]harness.Record {
	t.Helper()
	want := make(map[string]written, len(evs))
	for _, w := range evs {
		want[w.id] = w
	}
	got := map[string]harness.Record{}
	harness.ConsumeUntil(t, brokers, topicRegex, 2*time.Minute, func(all []harness.Record) bool {
		for _, r := range all {
			if _, ok := want[r.Headers["event_id"]]; ok {
				got[r.Headers["event_id"]] = r
			}
		}
		return len(got) == len(want)
	})
	for _, w := range evs {
		r := got[w.id]
		if !bytes.Equal(r.Value, w.payload) {
			t.Errorf("event %s: value %x, want %x", w.id, r.Value, w.payload)
		}
		if r.Headers["content-type"] != contentType || string(r.Key) != w.aggregateID {
			t.Errorf("event %s: key %q, content-type %q", w.id, r.Key, r.Headers["content-type"])
		}
	}
	return got
}

// unmarshals checks a record value parses as the Protobuf message that
// was marshalled into it.
func unmarshals(t *testing.T, value []byte, want proto.Message) {
	t.Helper()
	got := want.ProtoReflect().New().Interface()
	if err := proto.Unmarshal(value, got); err != nil || !proto.Equal(got, want) {
		t.Errorf("the %T reads back as %v, %v", want, got, err)
	}
}

func run(e *harness.Env, topicPrefix string) string {
	e.T.Helper()
	p := e.StartRelayNoWait("--content-type", contentType, "--topic", topicPrefix+".{aggregate_type}")
	p.WaitForOutput(e.T, `"record_format":"relay"`, time.Minute)
	return "^" + regexp.QuoteMeta(topicPrefix+".")
}

// Each source carries binary payloads as their bytes, with the configured
// content-type: a bytea column from the table sources, payload_base64 from
// the messages source.
func TestBinaryPayloadsFromEverySource(t *testing.T) {
	for _, src := range []string{"wal", "poll", "messages"} {
		t.Run(src, func(t *testing.T) {
			e := harness.NewRelayEnv(t, cluster, 3)
			e.Source = src
			setUp(t, e)
			evs := events(t, "order", "customer")
			write(t, e, evs)
			got := consume(t, e.Brokers, run(e, "bin-"+src), evs)
			for i, m := range messages(t) {
				unmarshals(t, got[evs[i].id].Value, m)
			}
		})
	}
}

// A binary event whose record Kafka refused (too large for its topic) is
// kept in the quarantine table as its bytes, and replay sends the same
// bytes once the topic takes them.
func TestQuarantinedBinaryPayloadReplays(t *testing.T) {
	for _, src := range []string{"wal", "poll", "messages"} {
		t.Run(src, func(t *testing.T) {
			e := harness.NewRelayEnv(t, cluster, 3)
			e.Source = src
			prefix := "bin-q-" + src
			small := prefix + ".customer"
			e.Kafka.CreateTopic(t, small, 3, map[string]string{"max.message.bytes": "1000"})
			setUp(t, e)
			evs := events(t, "order")
			big := wrapperspb.Bytes(bytes.Repeat([]byte{0xff, 0x00, 0x80}, 1000))
			oversize := written{id: harness.NewUUID(), aggregateType: "customer", aggregateID: "agg-9", payload: marshal(t, big)}
			write(t, e, append(evs, oversize))
			topics := run(e, prefix)
			consume(t, e.Brokers, topics, evs)
			harness.WaitFor(t, time.Minute, "the oversize event quarantined", func() bool {
				return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine") == 1
			})
			if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine WHERE payload IS NULL AND payload_bytes = $1", oversize.payload); n != 1 {
				t.Errorf("the quarantine table does not keep the payload's bytes")
			}

			e.Kafka.SetTopicConfig(t, small, "max.message.bytes", "1048588")
			e.Source = "" // replay reads the quarantine table, whatever the source
			code, out := harness.RunCommand(t, e.Bin, append([]string{"quarantine"},
				e.Args("replay", "--all", "--content-type", contentType, "--kafka-brokers", strings.Join(e.Brokers, ","),
					"--topic", prefix+".{aggregate_type}")...))
			if code != 0 {
				t.Fatalf("quarantine replay exited %d:\n%s", code, out)
			}
			got := consume(t, e.Brokers, topics, []written{oversize})
			unmarshals(t, got[oversize.id].Value, big)
		})
	}
}

// In both CloudEvents modes the official SDK reads a binary payload back
// as the bytes written, with their content type: the value in binary mode,
// data_base64 in structured mode.
func TestBinaryPayloadsAsCloudEvents(t *testing.T) {
	for _, format := range []string{"cloudevents", "cloudevents-structured"} {
		t.Run(format, func(t *testing.T) {
			e := harness.NewRelayEnv(t, cluster, 3)
			setUp(t, e)
			evs := events(t, "order")
			write(t, e, evs)
			prefix := "bin-" + format
			p := e.StartRelayNoWait("--record-format", format, "--cloudevents-source", "/billing", "--content-type", contentType,
				"--topic", prefix+".{aggregate_type}")
			p.WaitForOutput(e.T, fmt.Sprintf(`"record_format":%q`, format), time.Minute)
			want := make(map[string][]byte, len(evs))
			for _, w := range evs {
				want[w.id] = w.payload
			}
			got := map[string]*cloudevents.Event{}
			var problems []string
			harness.ConsumeUntil(t, e.Brokers, "^"+regexp.QuoteMeta(prefix+"."), 2*time.Minute, func(all []harness.Record) bool {
				for _, r := range all {
					ev, _, err := harness.CloudEvent(r)
					if err != nil {
						problems = append(problems, err.Error())
						continue
					}
					got[ev.ID()] = ev
				}
				return len(got) == len(want) || len(problems) > 0
			})
			if len(problems) > 0 {
				t.Fatalf("the SDK refused %d records, the first: %s", len(problems), problems[0])
			}
			for id, payload := range want {
				ev := got[id]
				if ev == nil || !bytes.Equal(ev.Data(), payload) || ev.DataContentType() != contentType {
					t.Errorf("event %s: %v", id, ev)
				}
			}
		})
	}
}

// columnContentTypes are the per-row media types of the
// --column-content-type tests, by event; "" is a NULL column.
var columnContentTypes = []string{"application/x-protobuf; messageType=Struct", "application/vnd.apache.avro+binary", ""}

// writeWithContentTypes adds a content_type column to the table sources'
// table and writes evs with columnContentTypes in turn.
func writeWithContentTypes(t *testing.T, e *harness.Env, evs []written) []string {
	t.Helper()
	e.DB.Exec(t, "ALTER TABLE outbox_events ADD COLUMN content_type text")
	conn := e.DB.Connect(t)
	types := make([]string, len(evs))
	for i, w := range evs {
		types[i] = columnContentTypes[i%len(columnContentTypes)]
		var ct any
		if types[i] != "" {
			ct = types[i]
		}
		if _, err := conn.Exec(context.Background(), `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, content_type)
			VALUES ($1, $2, $3, 'com.example.Happened', $4, $5)`, w.id, w.aggregateType, w.aggregateID, w.payload, ct); err != nil {
			t.Fatal(err)
		}
	}
	return types
}

// With --column-content-type, each row's content type goes into its
// record's content-type header, through the WAL and poll sources; a NULL
// falls back to --content-type. A row Kafka refused keeps its content type
// through the quarantine, and replay sends it again.
func TestContentTypeFromColumn(t *testing.T) {
	for _, src := range []string{"wal", "poll"} {
		t.Run(src, func(t *testing.T) {
			e := harness.NewRelayEnv(t, cluster, 3)
			e.Source = src
			prefix := "bin-ct-" + src
			small := prefix + ".customer"
			e.Kafka.CreateTopic(t, small, 3, map[string]string{"max.message.bytes": "1000"})
			setUp(t, e)
			evs := events(t, "order")
			oversize := written{id: harness.NewUUID(), aggregateType: "customer", aggregateID: "agg-9", payload: bytes.Repeat([]byte{0xff, 0x00}, 1000)}
			types := writeWithContentTypes(t, e, append(evs, oversize))
			topics := "^" + regexp.QuoteMeta(prefix+".")
			p := e.StartRelayNoWait("--column-content-type", "content_type", "--content-type", contentType, "--topic", prefix+".{aggregate_type}")
			p.WaitForOutput(e.T, `"record_format":"relay"`, time.Minute)
			got := map[string]harness.Record{}
			harness.ConsumeUntil(t, e.Brokers, topics, 2*time.Minute, func(all []harness.Record) bool {
				for _, r := range all {
					got[r.EventID()] = r
				}
				return len(got) == len(evs)
			})
			for i, w := range evs {
				want := types[i]
				if want == "" {
					want = contentType
				}
				if r := got[w.id]; r.Headers["content-type"] != want || !bytes.Equal(r.Value, w.payload) {
					t.Errorf("event %d (column %q): content-type %q, value %x; want %q, %x", i, types[i], r.Headers["content-type"], r.Value, want, w.payload)
				}
			}

			harness.WaitFor(t, time.Minute, "the oversize event quarantined", func() bool {
				return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine") == 1
			})
			e.Kafka.SetTopicConfig(t, small, "max.message.bytes", "1048588")
			e.Source = ""
			code, out := harness.RunCommand(t, e.Bin, append([]string{"quarantine"},
				e.Args("replay", "--all", "--content-type", contentType, "--kafka-brokers", strings.Join(e.Brokers, ","),
					"--topic", prefix+".{aggregate_type}")...))
			if code != 0 {
				t.Fatalf("quarantine replay exited %d:\n%s", code, out)
			}
			var replayed harness.Record
			harness.ConsumeUntil(t, e.Brokers, "^"+regexp.QuoteMeta(small), time.Minute, func(all []harness.Record) bool {
				for _, r := range all {
					if r.EventID() == oversize.id {
						replayed = r
						return true
					}
				}
				return false
			})
			if want := types[len(evs)]; replayed.Headers["content-type"] != want || !bytes.Equal(replayed.Value, oversize.payload) {
				t.Errorf("replayed: content-type %q, %d bytes; want %q, the %d written", replayed.Headers["content-type"], len(replayed.Value), want, len(oversize.payload))
			}
		})
	}
}

// In CloudEvents binary mode, the official SDK reads each row's column as
// the event's datacontenttype.
func TestContentTypeFromColumnAsCloudEvents(t *testing.T) {
	e := harness.NewRelayEnv(t, cluster, 3)
	setUp(t, e)
	evs := events(t, "order")
	types := writeWithContentTypes(t, e, evs)
	prefix := "bin-ct-ce"
	p := e.StartRelayNoWait("--record-format", "cloudevents", "--cloudevents-source", "/billing", "--column-content-type", "content_type",
		"--content-type", contentType, "--topic", prefix+".{aggregate_type}")
	p.WaitForOutput(e.T, `"record_format":"cloudevents"`, time.Minute)
	got := map[string]*cloudevents.Event{}
	harness.ConsumeUntil(t, e.Brokers, "^"+regexp.QuoteMeta(prefix+"."), 2*time.Minute, func(all []harness.Record) bool {
		for _, r := range all {
			if ev, _, err := harness.CloudEvent(r); err == nil {
				got[ev.ID()] = ev
			}
		}
		return len(got) == len(evs)
	})
	for i, w := range evs {
		want := types[i]
		if want == "" {
			want = contentType
		}
		if ev := got[w.id]; ev == nil || ev.DataContentType() != want || !bytes.Equal(ev.Data(), w.payload) {
			t.Errorf("event %d (column %q): %v; want datacontenttype %q", i, types[i], ev, want)
		}
	}
}
