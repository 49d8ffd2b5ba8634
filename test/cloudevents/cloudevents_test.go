// Package cloudevents_test runs the relay binary with --record-format
// cloudevents and cloudevents-structured, from each source (wal, poll,
// messages), against a private PostgreSQL and kfake or Apache Kafka, and
// reads every record back with franz-go. The official CloudEvents Go SDK,
// not the relay's code, then decodes each record through its Kafka binding
// and validates the event; the test compares its attributes and data with
// what it wrote.
package cloudevents_test

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding"
	cloudevents "github.com/cloudevents/sdk-go/v2/event"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/inbox/inboxkgo"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// cluster is the PostgreSQL cluster the package's tests share; each test
// gets its own database, and so its own slot.
var cluster *harness.Postgres

func TestMain(m *testing.M) {
	harness.MainWithPostgres(m, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "20s"}},
		func(pg *harness.Postgres) { cluster = pg })
}

// source is the CloudEvents source attribute the relay is given.
const source = "https://example.com/billing/outbox"

// modes are the two CloudEvents formats and the binding's encoding each
// must give.
var modes = []struct {
	format   string
	encoding binding.Encoding
}{
	{"cloudevents", binding.EncodingBinary},
	{"cloudevents-structured", binding.EncodingStructured},
}

// written is one event the test writes, with everything the CloudEvent
// must carry.
type written struct {
	id, aggregateType, aggregateID, eventType string
	payload                                   string // JSON
	headers                                   map[string]string
	at                                        time.Time
}

// events are n events over a few aggregates, one of whose ids needs
// escaping in JSON, with occurred_at times of microsecond precision in
// another zone than UTC, and every third with headers of its own.
func events(n int) []written {
	base := time.Date(2026, 12, 2, 10, 30, 15, 123456000, time.FixedZone("CET", 3600))
	out := make([]written, n)
	for i := range out {
		w := written{id: harness.NewUUID(), aggregateType: []string{"order", "customer"}[i%2], aggregateID: fmt.Sprintf("agg-%d", i%5),
			eventType: fmt.Sprintf("com.example.Happened.v%d", 1+i%2), at: base.Add(time.Duration(i) * 1001 * time.Microsecond),
			payload: fmt.Sprintf(`{"n": %d, "note": "caf\u00e9 \"quoted\"", "list": [1, 2.50, null]}`, i)}
		if i%5 == 4 {
			w.aggregateID = `o/"7"\x`
		}
		if i%3 == 0 {
			w.headers = map[string]string{"tenant": fmt.Sprintf("t%d", i%4), "traceparent": fmt.Sprintf("00-%032x-%016x-01", i+1, i+1)}
		}
		out[i] = w
	}
	return out
}

// insertSQL writes one event as an outbox row, for the wal and poll
// sources.
const insertSQL = `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at)
	VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7)`

// emitSQL writes one event as a logical decoding message, for the messages
// source, with the same members.
const emitSQL = `SELECT pg_logical_emit_message(true, 'outbox', (jsonb_build_object(
	'event_id', $1::uuid, 'aggregate_type', $2::text, 'aggregate_id', $3::text, 'event_type', $4::text,
	'payload', $5::jsonb, 'occurred_at', $7::timestamptz)
	|| CASE WHEN $6::jsonb IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('headers', $6::jsonb) END)::text)`

// write commits the events, a few per transaction, as rows or as
// messages.
func write(t *testing.T, conn *pgx.Conn, sql string, evs []written) {
	t.Helper()
	ctx := context.Background()
	for start := 0; start < len(evs); start += 4 {
		batch := &pgx.Batch{}
		for _, w := range evs[start:min(start+4, len(evs))] {
			var headers any
			if w.headers != nil {
				raw, _ := json.Marshal(w.headers)
				headers = string(raw)
			}
			batch.Queue(sql, w.id, w.aggregateType, w.aggregateID, w.eventType, w.payload, headers, w.at)
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.SendBatch(ctx, batch).Close(); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// decoded is one record as the SDK read it.
type decoded struct {
	record   harness.Record
	event    *cloudevents.Event
	encoding binding.Encoding
}

// decode lets the SDK read a consumed record (see harness.CloudEvent).
func decode(r harness.Record) (decoded, error) {
	ev, encoding, err := harness.CloudEvent(r)
	return decoded{record: r, encoding: encoding, event: ev}, err
}

// consume reads the topics until the SDK has decoded an event for every
// written id, failing the test on any record it cannot decode.
func consume(t *testing.T, brokers []string, topicRegex string, evs []written) map[string]decoded {
	t.Helper()
	missing := make(map[string]bool, len(evs))
	for _, w := range evs {
		missing[w.id] = true
	}
	got := map[string]decoded{}
	seen := 0
	var problems []string
	harness.ConsumeUntil(t, brokers, topicRegex, 2*time.Minute, func(all []harness.Record) bool {
		for _, r := range all[seen:] {
			d, err := decode(r)
			if err != nil {
				problems = append(problems, err.Error())
				continue
			}
			got[d.event.ID()] = d
			delete(missing, d.event.ID())
		}
		seen = len(all)
		return len(missing) == 0 || len(problems) > 0
	})
	if len(problems) > 0 {
		t.Fatalf("%d records the SDK refused, the first: %s", len(problems), problems[0])
	}
	return got
}

// check compares every decoded event with the event written: encoding,
// key, every attribute, the data (as JSON: jsonb normalises the text) and
// the row's own headers, which arrive as Kafka headers.
func check(t *testing.T, evs []written, got map[string]decoded, encoding binding.Encoding) {
	t.Helper()
	for _, w := range evs {
		d := got[w.id]
		ev := d.event
		var problems []string
		if d.encoding != encoding {
			problems = append(problems, fmt.Sprintf("encoding %v, want %v", d.encoding, encoding))
		}
		if string(d.record.Key) != w.aggregateID {
			problems = append(problems, fmt.Sprintf("key %q, want %q", d.record.Key, w.aggregateID))
		}
		for _, a := range []struct{ name, got, want string }{
			{"specversion", ev.SpecVersion(), "1.0"},
			{"id", ev.ID(), w.id},
			{"type", ev.Type(), w.eventType},
			{"source", ev.Source(), source},
			{"subject", ev.Subject(), w.aggregateID},
			{"datacontenttype", ev.DataContentType(), "application/json"},
		} {
			if a.got != a.want {
				problems = append(problems, fmt.Sprintf("%s %q, want %q", a.name, a.got, a.want))
			}
		}
		if !ev.Time().Equal(w.at) {
			problems = append(problems, fmt.Sprintf("time %s, want %s", ev.Time().Format(time.RFC3339Nano), w.at.Format(time.RFC3339Nano)))
		}
		var data, want any
		if err := json.Unmarshal(ev.Data(), &data); err != nil || json.Unmarshal([]byte(w.payload), &want) != nil || !reflect.DeepEqual(data, want) {
			problems = append(problems, fmt.Sprintf("data %s, want %s", ev.Data(), w.payload))
		}
		for k, v := range w.headers {
			if d.record.Headers[k] != v {
				problems = append(problems, fmt.Sprintf("Kafka header %s %q, want %q", k, d.record.Headers[k], v))
			}
		}
		if len(problems) > 0 {
			t.Errorf("event %s (record %s/%d@%d): %s", w.id, d.record.Topic, d.record.Partition, d.record.Offset, strings.Join(problems, "; "))
		}
	}
}

// run starts the relay with the format and a topic template of its own,
// waits for its first line to name the format, so an operator can tell
// from the log what consumers get, and returns the regex of its topics.
func run(e *harness.Env, format, topicPrefix string) string {
	e.T.Helper()
	p := e.StartRelayNoWait("--record-format", format, "--cloudevents-source", source, "--topic", topicPrefix+".{aggregate_type}")
	p.WaitForOutput(e.T, fmt.Sprintf(`"record_format":%q`, format), time.Minute)
	return "^" + regexp.QuoteMeta(topicPrefix+".")
}

// Every source makes valid CloudEvents in both modes: the SDK decodes each
// record in the mode asked for and finds the attributes and data written.
func TestEverySourceMakesCloudEventsTheSDKReads(t *testing.T) {
	for _, src := range []string{"wal", "poll", "messages"} {
		for _, mode := range modes {
			t.Run(src+"/"+mode.format, func(t *testing.T) {
				// Poll mode reads no slot, but the slot name it is given
				// must still be valid.
				e := harness.NewRelayEnv(t, cluster, 6)
				e.Source = src
				sql := insertSQL
				if src == "messages" {
					sql = emitSQL
				}
				e.Migrate()
				evs := events(40)
				write(t, e.DB.Connect(t), sql, evs)
				topics := run(e, mode.format, "ce-"+src)
				check(t, evs, consume(t, e.Brokers, topics, evs), mode.encoding)
			})
		}
	}
}

// The same on Apache Kafka, whose record batches and headers are the real
// broker's rather than kfake's imitation.
func TestCloudEventsOnApacheKafka(t *testing.T) {
	k := harness.RequireApacheKafka(t, harness.ApacheKafkaOptions{Version: harness.ApacheKafka4Version, Nodes: 1})
	for _, mode := range modes {
		t.Run(mode.format, func(t *testing.T) {
			e := harness.NewRelayEnv(t, cluster, 0)
			e.Brokers = k.Brokers()
			prefix := "ce-apache-" + mode.format
			for _, aggregateType := range []string{"order", "customer"} {
				if err := k.CreateTopic(prefix+"."+aggregateType, 3, 1, nil); err != nil {
					t.Fatalf("%v%s", err, k.LogTail(0, 30))
				}
			}
			e.Migrate()
			evs := events(30)
			write(t, e.DB.Connect(t), insertSQL, evs)
			topics := run(e, mode.format, prefix)
			check(t, evs, consume(t, e.Brokers, topics, evs), mode.encoding)
		})
	}
}

// Both ways into the quarantine keep a CloudEvent whole, and replay sends
// it as the SDK reads it: a record Kafka refused (too large for its topic)
// is stored from the record, an event whose headers set a binding's name
// (ce_type) is stored from the event before any record exists. The first
// replays once the topic takes it, the second once its headers are fixed.
func TestQuarantinedCloudEventsReplay(t *testing.T) {
	for _, mode := range modes {
		t.Run(mode.format, func(t *testing.T) {
			e := harness.NewRelayEnv(t, cluster, 6)
			prefix := "ce-q-" + mode.format
			big := prefix + ".customer"
			e.Kafka.CreateTopic(t, big, 6, map[string]string{"max.message.bytes": "2000"})
			e.Migrate()
			evs := events(6)
			oversize, clash := evs[1], evs[2] // customer, order
			oversize.payload = fmt.Sprintf(`{"blob": %q}`, strings.Repeat("x", 4000))
			evs[1] = oversize
			clash.headers = map[string]string{"tenant": "t9", "ce_type": "com.example.NotMine"}
			evs[2] = clash
			write(t, e.DB.Connect(t), insertSQL, evs)
			topics := run(e, mode.format, prefix)

			var rest []written
			for _, w := range evs {
				if w.id != oversize.id && w.id != clash.id {
					rest = append(rest, w)
				}
			}
			check(t, rest, consume(t, e.Brokers, topics, rest), mode.encoding)
			harness.WaitFor(t, time.Minute, "both events quarantined", func() bool {
				return e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine") == 2
			})
			if msg := e.DB.QueryString(t, "SELECT error_message FROM outbox_quarantine WHERE event_id = $1", clash.id); !strings.Contains(msg, `"ce_type", which the CloudEvents binding reads`) {
				t.Errorf("the clashing event is quarantined with %q", msg)
			}

			e.Kafka.SetTopicConfig(t, big, "max.message.bytes", "1048588")
			e.DB.Exec(t, "UPDATE outbox_quarantine SET headers = headers - 'ce_type' WHERE event_id = $1", clash.id)
			delete(clash.headers, "ce_type")
			code, out := harness.RunCommand(t, e.Bin, append([]string{"quarantine"},
				e.Args("replay", "--all", "--record-format", mode.format, "--cloudevents-source", source, "--kafka-brokers", strings.Join(e.Brokers, ","),
					"--topic", prefix+".{aggregate_type}")...))
			if code != 0 {
				t.Fatalf("quarantine replay exited %d:\n%s", code, out)
			}
			replayed := []written{oversize, clash}
			check(t, replayed, consume(t, e.Brokers, topics, replayed), mode.encoding)
		})
	}
}

// The inbox reads the relay's CloudEvents in both modes: a franz-go
// consumer applies every event through inboxkgo with version checks on,
// each once, with the id, type, subject, version and data written.
// CloudEvents carry no aggregate type, so the versions here run per
// aggregate id, on one topic.
func TestInboxAppliesCloudEvents(t *testing.T) {
	for _, mode := range modes {
		t.Run(mode.format, func(t *testing.T) {
			e := harness.NewRelayEnv(t, cluster, 6)
			e.Migrate()
			evs := events(40)
			versions := map[string]int{}
			for i := range evs {
				versions[evs[i].aggregateID]++
				if evs[i].headers == nil {
					evs[i].headers = map[string]string{}
				}
				evs[i].headers["aggregate_version"] = fmt.Sprint(versions[evs[i].aggregateID])
			}
			write(t, e.DB.Connect(t), insertSQL, evs)
			topic := "ce-inbox-" + mode.format
			p := e.StartRelayNoWait("--record-format", mode.format, "--cloudevents-source", source, "--topic", topic)
			p.WaitForOutput(t, fmt.Sprintf(`"record_format":%q`, mode.format), time.Minute)

			consumerDB := cluster.CreateTestDatabase(t)
			schema, err := inbox.SQL(inbox.Tables{})
			if err != nil {
				t.Fatal(err)
			}
			consumerDB.Exec(t, schema)
			consumerDB.Exec(t, `CREATE TABLE applied (event_id text PRIMARY KEY, aggregate_id text, event_type text, version bigint, payload text, content_type text)`)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			pool, err := pgxpool.New(ctx, consumerDB.DSN())
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			ib, err := inbox.New(inbox.Config{Consumer: "ce-test", CheckVersions: true})
			if err != nil {
				t.Fatal(err)
			}
			cl, err := kgo.NewClient(kgo.SeedBrokers(e.Brokers...), kgo.ConsumerGroup("ce-inbox"), kgo.ConsumeTopics(topic),
				kgo.AutoCommitMarks(), kgo.BlockRebalanceOnPoll(), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			failures := make(chan error, 1)
			c := &inboxkgo.Consumer{Client: cl, Inbox: ib, DB: pool, CommitEach: true,
				Handler: func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
					_, err := tx.Exec(ctx, `INSERT INTO applied VALUES ($1, $2, $3, $4, $5, $6)`,
						ev.ID, ev.AggregateID, ev.EventType, ev.Version, string(ev.Payload), ev.Headers["content-type"])
					return err
				},
				OnError: func(_ *kgo.Record, err error) {
					select {
					case failures <- err:
					default:
					}
				}}
			go func() { _ = c.Run(ctx) }()
			harness.WaitFor(t, time.Minute, "every event applied", func() bool {
				select {
				case err := <-failures:
					t.Fatalf("the inbox failed a record: %v", err)
				default:
				}
				return consumerDB.QueryInt64(t, `SELECT count(*) FROM applied`) == int64(len(evs))
			})
			for _, w := range evs {
				var aggregateID, eventType, payload, contentType string
				var version int64
				err := pool.QueryRow(ctx, `SELECT aggregate_id, event_type, version, payload, content_type FROM applied WHERE event_id = $1`, w.id).
					Scan(&aggregateID, &eventType, &version, &payload, &contentType)
				if err != nil {
					t.Fatalf("event %s: %v", w.id, err)
				}
				var got, want any
				if err := json.Unmarshal([]byte(payload), &got); err != nil {
					t.Fatalf("event %s: payload %q is no JSON: %v", w.id, payload, err)
				}
				_ = json.Unmarshal([]byte(w.payload), &want)
				if aggregateID != w.aggregateID || eventType != w.eventType || fmt.Sprint(version) != w.headers["aggregate_version"] ||
					!reflect.DeepEqual(got, want) || contentType != "application/json" {
					t.Errorf("event %s applied as (%q, %q, v%d, %s, %q), written as (%q, %q, v%s, %s)", w.id, aggregateID, eventType, version,
						payload, contentType, w.aggregateID, w.eventType, w.headers["aggregate_version"], w.payload)
				}
			}
			if n := consumerDB.QueryInt64(t, `SELECT count(*) FROM inbox_parked`); n != 0 {
				t.Errorf("%d events parked: the versions came out of order", n)
			}
		})
	}
}
