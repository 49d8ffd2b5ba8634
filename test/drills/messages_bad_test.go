package drills

import (
	"context"
	"crypto/sha256"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// badKafka is the Kafka a bad-content drill runs on: its brokers, and how
// to create a topic with a configuration of its own.
type badKafka struct {
	brokers     []string
	createTopic func(t *testing.T, name string, configs map[string]string)
}

// TestDrillMessagesBadContent (issue 40): a writer can emit anything into a
// logical decoding message, and every slot of the database receives it, so
// one message that could not be kept stopped every messages relay of the
// database at every start. Two messages relays, one at-least-once and one
// exactly-once, each with its own slot and quarantine table, read one
// database while a writer commits good events and every kind of bad
// message is emitted between them, some inside the good events'
// transactions: not JSON, not an object, an event_id that is no UUID,
// bytes that are no UTF-8 (the bytea form), U+0000 escaped in the payload,
// U+0000 in aggregate_type (an invalid topic, and text PostgreSQL
// refuses), a member given twice, invalid base64, a payload over the
// topic's max.message.bytes. Checked with the
// independent client (read_committed): every good event delivered by both,
// in per-aggregate order, once for the exactly-once relay; no bad one
// published; every bad one in both quarantine tables, with the content as
// emitted; the two relays' records the same byte for byte; neither relay
// exits or restarts.
//
// On kfake, and on Apache Kafka when it can run here. Reduced: 3 rounds of
// bad messages, a 2 MB oversize payload; OUTBOX_RELAY_DRILL_SIZE=full: 15
// rounds, 16 MB. (A payload over jsonb's 256 MB limit is
// TestPutStoresAPayloadOverJSONBsLimit in store, at full size.)
func TestDrillMessagesBadContent(t *testing.T) {
	t.Run("kfake", func(t *testing.T) {
		k := harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: partitions})
		badContentDrill(t, "", badKafka{brokers: k.Brokers(), createTopic: func(t *testing.T, name string, configs map[string]string) {
			k.CreateTopic(t, name, partitions, configs)
		}})
	})
	t.Run("apache-kafka", func(t *testing.T) {
		k := harness.RequireApacheKafka(t, harness.ApacheKafkaOptions{Nodes: 1})
		badContentDrill(t, fmt.Sprintf("bad%d.", time.Now().UnixNano()%1e9), badKafka{brokers: k.Brokers(),
			createTopic: func(t *testing.T, name string, configs map[string]string) {
				if err := k.CreateTopic(name, partitions, 1, configs); err != nil {
					t.Fatal(err)
				}
			}})
	})
}

func badContentDrill(t *testing.T, prefix string, kafka badKafka) {
	rounds := harness.Sized(3, 15)
	oversize := harness.Sized(2<<20, 16<<20)
	// Over --max-message-bytes (set below), so the relays drop it unread.
	huge := harness.Sized(40<<20, 200<<20)
	rng := newRand(t)
	w := newWorld(t, shared, kafka.brokers)
	w.Source = "messages"
	w.EmitMessages(t, w.DB, "outbox")
	alo, eos := prefix+"alo.", prefix+"eos."
	for _, p := range []string{alo, eos} {
		for _, typ := range w.types {
			kafka.createTopic(t, p+typ, nil)
		}
		// Small, so an oversize event costs little.
		kafka.createTopic(t, p+"big", map[string]string{"max.message.bytes": "100000"})
	}
	w.Migrate()
	eosSlot, eosQuarantine := w.Slot+"_eos", "public.quarantine_eos"
	harness.Migrate(t, w.Bin, []string{"migrate", "--pg-dsn", w.DB.DSN(), "--slot", eosSlot, "--source", "messages", "--quarantine-table", eosQuarantine})
	w.DB.DropSlotAtEnd(t, eosSlot)

	flags := func(slot, topics string, extra ...string) []string {
		return harness.RelayFlags{DSN: w.DB.DSN(), Slot: slot, Brokers: kafka.brokers, Topic: topics + "{aggregate_type}"}.
			Args("run", append([]string{"--source", "messages", "--max-message-bytes", strconv.Itoa(maxMessageBytes)}, extra...)...)
	}
	relays := map[string]*harness.Process{
		"at-least-once": harness.StartStreaming(t, w.Bin, flags(w.Slot, alo), harness.LogLevelInfo),
		"exactly-once": harness.StartStreaming(t, w.Bin, flags(eosSlot, eos, append([]string{"--quarantine-table", eosQuarantine}, eosFlags...)...),
			harness.LogLevelInfo),
	}

	pw := startPacedWriter(w, w.connect(), writerRand(rng), 5*time.Millisecond, 7, 300, false)
	defer pw.halt()
	var bad badMessages
	conn := w.connect()
	for round := range rounds {
		for _, c := range bad.round(round, oversize, huge) {
			bad.emit(t, w, conn, c, round%2 == 1)
		}
		harness.WaitFor(t, time.Minute, "the writer commits more events", func() bool {
			return relaysExited(relays) != "" || pw.events.Load() >= int64(200*(round+1))
		})
		if name := relaysExited(relays); name != "" {
			t.Fatalf("the %s relay exited:\n%s", name, relays[name].Output())
		}
	}
	if err := pw.halt(); err != nil {
		t.Fatal(err)
	}
	// A last good transaction, after every bad message.
	if err := w.writeTxns(conn, rng, 5, 7, 300); err != nil {
		t.Fatal(err)
	}

	ids, order := w.Committed()
	aloRecords := harness.ConsumeEventIDs(t, kafka.brokers, "^"+regexp.QuoteMeta(alo), ids, 3*time.Minute)
	harness.CheckNoLoss(t, aloRecords, ids)
	harness.CheckPerAggregateOrder(t, aloRecords, order)
	eosRecords := harness.ConsumeExactlyOnce(t, kafka.brokers, "^"+regexp.QuoteMeta(eos), ids, 3*time.Minute)
	harness.CheckPerAggregateOrder(t, eosRecords, order)
	checkTxnsCommitted(t, relays["exactly-once"].Output())

	committed := map[string]bool{}
	for _, id := range ids {
		committed[id] = true
	}
	first := map[string]harness.Record{}
	for _, r := range harness.FirstDeliveries(aloRecords) {
		if !committed[r.EventID()] {
			t.Errorf("event %s published at %s/%d@%d by the at-least-once relay, but no good event has that id", r.EventID(), r.Topic, r.Partition, r.Offset)
		}
		first[r.EventID()] = r
	}
	for _, e := range eosRecords {
		a := first[e.EventID()]
		if strings.TrimPrefix(e.Topic, eos) != strings.TrimPrefix(a.Topic, alo) || e.Partition != a.Partition || string(e.Key) != string(a.Key) ||
			string(e.Value) != string(a.Value) || !slices.Equal(e.HeaderKeys, a.HeaderKeys) ||
			!slices.EqualFunc(e.HeaderValues, a.HeaderValues, func(x, y []byte) bool { return string(x) == string(y) }) {
			t.Errorf("event %s differs between the relays:\nexactly-once:  %s/%d key %q value %.200q headers %q\nat-least-once: %s/%d key %q value %.200q headers %q",
				e.EventID(), e.Topic, e.Partition, e.Key, e.Value, e.HeaderValues, a.Topic, a.Partition, a.Key, a.Value, a.HeaderValues)
		}
	}

	// Every bad message is in both quarantine tables, as it was emitted.
	tables := []string{"public.outbox_quarantine", eosQuarantine}
	for _, table := range tables {
		harness.WaitFor(t, time.Minute, fmt.Sprintf("%d bad messages in %s", len(bad.all), table), func() bool {
			return relaysExited(relays) != "" || w.DB.QueryInt64(t, "SELECT count(*) FROM "+table) >= int64(len(bad.all))
		})
		if n := w.DB.QueryInt64(t, "SELECT count(*) FROM "+table); n != int64(len(bad.all)) {
			t.Errorf("%s holds %d rows, want the %d bad messages", table, n, len(bad.all))
		}
		var withRaw []string
		rows, err := w.connect().Query(context.Background(), "SELECT raw FROM "+table+" WHERE raw IS NOT NULL AND content_problem IS NOT NULL")
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var raw []byte
			if err := rows.Scan(&raw); err != nil {
				t.Fatal(err)
			}
			withRaw = append(withRaw, string(raw))
		}
		if rows.Err() != nil {
			t.Fatal(rows.Err())
		}
		slices.Sort(withRaw)
		if want := bad.withProblem(); !slices.Equal(withRaw, want) {
			t.Errorf("%s keeps %d contents with a problem, want the %d emitted as they were (first differing: %s)", table, len(withRaw), len(want), firstDiff(withRaw, want))
		}
		if named := bad.named(); w.DB.QueryInt64(t, "SELECT count(*) FROM "+table+" WHERE event_id = ANY($1::uuid[])", named) != int64(len(named)) {
			t.Errorf("%s lacks some of the %d bad messages that name a valid event_id", table, len(named))
		}
		if n := w.DB.QueryInt64(t, "SELECT count(*) FROM "+table+" WHERE event_id = ANY($1::uuid[]) AND content_problem IS NULL AND payload IS NOT NULL", bad.oversizeIDs); n != int64(len(bad.oversizeIDs)) {
			t.Errorf("%s holds %d of the %d oversize events as typed rows", table, n, len(bad.oversizeIDs))
		}
		if n := w.DB.QueryInt64(t, "SELECT count(*) FROM "+table+` WHERE raw IS NULL AND raw_lsn IS NOT NULL AND content_problem LIKE '%over --max-message-bytes%'
			AND encode(raw_sha256, 'hex') || ':' || raw_size = ANY($1::text[])`, bad.dropped()); n != int64(len(bad.dropped())) {
			t.Errorf("%s keeps %d of the %d messages over --max-message-bytes by reference", table, n, len(bad.dropped()))
		}
	}
	// Both relays kept the same rows of the same messages.
	if n := w.DB.QueryInt64(t, `SELECT count(*) FROM (
		(SELECT event_id, raw, content_problem, aggregate_type, payload::text FROM public.outbox_quarantine
		 EXCEPT SELECT event_id, raw, content_problem, aggregate_type, payload::text FROM `+eosQuarantine+`)
		UNION ALL
		(SELECT event_id, raw, content_problem, aggregate_type, payload::text FROM `+eosQuarantine+`
		 EXCEPT SELECT event_id, raw, content_problem, aggregate_type, payload::text FROM public.outbox_quarantine)) d`); n != 0 {
		t.Errorf("the two quarantine tables differ in %d rows", n)
	}
	for name, p := range relays {
		if p.Exited() {
			t.Errorf("the %s relay exited:\n%s", name, p.Output())
		} else if n := strings.Count(p.Output(), msgRestart); n != 0 {
			t.Errorf("the %s relay restarted its stream %d times:\n%s", name, n, harness.LastLines(p.Output(), 20))
		}
	}
	t.Logf("bad-content drill: %d good events delivered by both relays, %d bad messages quarantined by both", len(ids), len(bad.all))
}

// relaysExited names a relay that exited, "" when none did.
func relaysExited(relays map[string]*harness.Process) string {
	for name, p := range relays {
		if p.Exited() {
			return name
		}
	}
	return ""
}

// firstDiff is the first element where two sorted lists differ, cut short.
func firstDiff(a, b []string) string {
	for i := range max(len(a), len(b)) {
		switch {
		case i >= len(a):
			return fmt.Sprintf("missing %.120q", b[i])
		case i >= len(b):
			return fmt.Sprintf("unexpected %.120q", a[i])
		case a[i] != b[i]:
			return fmt.Sprintf("%.120q against %.120q", a[i], b[i])
		}
	}
	return "none"
}

// badMessage is one content the relays must not publish.
type badMessage struct {
	content string
	// problem: the content is no event, so its row keeps it in raw with a
	// content_problem; false for a valid event Kafka refuses (oversize).
	problem bool
	id      string // the event_id the row has, when the content names a valid one
	// binary emits the content as bytea, which may hold any byte.
	binary bool
	// dropped: over --max-message-bytes, kept by reference alone.
	dropped bool
}

// badMessages are the bad messages a drill emitted.
type badMessages struct {
	all         []badMessage
	oversizeIDs []string
}

// round is one of each kind of bad message, unique to the round.
func (b *badMessages) round(round, oversize, huge int) []badMessage {
	id := func() string { return harness.NewUUID() }
	rest := fmt.Sprintf(`"aggregate_id":"bad-%d","event_type":"Bad","payload":{"round":%d}`, round, round)
	dup, nulAgg, base64 := id(), id(), id()
	big := id()
	b.oversizeIDs = append(b.oversizeIDs, big)
	return []badMessage{
		{content: fmt.Sprintf(`not json {round %d`, round), problem: true},
		{content: fmt.Sprintf(`[%d, "not an object"]`, round), problem: true},
		{content: fmt.Sprintf("\xff\x00 not UTF-8 %d", round), problem: true, binary: true},
		{content: fmt.Sprintf(`{"event_id":"nope-%d","aggregate_type":"order",%s}`, round, rest), problem: true},
		{content: fmt.Sprintf(`{"event_id":"nope-nul-%d","aggregate_type":"order","aggregate_id":"bad","event_type":"Bad","payload":{"s":"a\u0000b","round":%d}}`, round, round), problem: true},
		{content: fmt.Sprintf(`{"event_id":"%s","aggregate_type":"or\u0000der",%s}`, nulAgg, rest), problem: true, id: nulAgg},
		{content: fmt.Sprintf(`{"event_id":"%s","event_id":"%s","aggregate_type":"order",%s}`, dup, id(), rest), problem: true, id: dup},
		{content: fmt.Sprintf(`{"event_id":"%s","aggregate_type":"order","aggregate_id":"bad-%d","event_type":"Bad","payload_base64":"not base64!"}`, base64, round),
			problem: true, id: base64},
		{content: fmt.Sprintf(`{"event_id":"%s","aggregate_type":"big","aggregate_id":"bad-%d","event_type":"Big","payload":{"pad":"%s"}}`,
			big, round, strings.Repeat("x", oversize)), id: big},
		{content: fmt.Sprintf(`{"event_id":"%s","aggregate_type":"huge","aggregate_id":"bad-%d","event_type":"Huge","payload":{"pad":"%s"}}`,
			id(), round, strings.Repeat("y", huge)), dropped: true},
	}
}

// maxMessageBytes is the relays' --max-message-bytes: above the oversize
// kind (quarantined whole), below the huge one (dropped unread).
const maxMessageBytes = 32 << 20

// dropped are the messages over --max-message-bytes as the quarantine
// keeps their reference: the SHA-256 in hex, ':', the size.
func (b *badMessages) dropped() []string {
	var out []string
	for _, m := range b.all {
		if m.dropped {
			out = append(out, fmt.Sprintf("%x:%d", sha256.Sum256([]byte(m.content)), len(m.content)))
		}
	}
	return out
}

// emit commits a bad message in a transaction of its own, or between two
// good events of one transaction, which the ledger then records.
func (b *badMessages) emit(t *testing.T, w *world, conn *pgx.Conn, m badMessage, withGood bool) {
	t.Helper()
	ctx := context.Background()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var ids []string
	var events []harness.OutboxEvent
	good := func() {
		if !withGood {
			return
		}
		n := int(w.seq.Add(1))
		// Aggregates the paced writer never writes: commit order is then
		// this goroutine's order.
		e := harness.NumberedEvent(n, 1000+n%6, fmt.Sprintf(`{"n": %d, "beside_a_bad_message": true}`, n))
		var headers any
		if e.Headers != "" {
			headers = e.Headers
		}
		gid := harness.NewUUID()
		if _, err := tx.Exec(ctx, "INSERT INTO "+harness.EmittedTable+" (event_id, aggregate_id) VALUES ($1, $2)", gid, e.AggregateID); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, harness.EmitSQL, "outbox", gid, e.AggregateType, e.AggregateID, e.EventType, e.Payload, headers); err != nil {
			t.Fatal(err)
		}
		ids, events = append(ids, gid), append(events, e)
	}
	good()
	emit, content := "SELECT pg_logical_emit_message(true, 'outbox', $1::text)", any(m.content)
	if m.binary {
		emit, content = "SELECT pg_logical_emit_message(true, 'outbox', $1::bytea)", []byte(m.content)
	}
	if _, err := tx.Exec(ctx, emit, content); err != nil {
		t.Fatalf("emit a bad message: %v", err)
	}
	good()
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	b.all = append(b.all, m)
	w.Record(ids, events)
}

// named are the event_ids of the bad messages that name a valid one.
func (b *badMessages) named() []string {
	var out []string
	for _, m := range b.all {
		if m.id != "" {
			out = append(out, m.id)
		}
	}
	return out
}

// withProblem are the contents that are no event, sorted: what the
// quarantine tables must keep in raw.
func (b *badMessages) withProblem() []string {
	var out []string
	for _, m := range b.all {
		if m.problem {
			out = append(out, m.content)
		}
	}
	slices.Sort(out)
	return out
}
