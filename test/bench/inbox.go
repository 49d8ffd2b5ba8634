package main

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/inbox/inboxsarama"
)

// InboxResult is one consumer draining the inbox part's backlog.
type InboxResult struct {
	Broker   string `json:"broker"`
	Rep      int    `json:"rep"`
	Consumer string `json:"consumer"`
	Events   int    `json:"events"`
	// Seconds runs from the consumer group's start to the last effect
	// committed.
	Seconds      float64 `json:"seconds"`
	EventsPerSec float64 `json:"events_per_sec"`
	// RatioToNaive is EventsPerSec ÷ the naive consumer's in the same
	// repetition on the same broker.
	RatioToNaive float64 `json:"ratio_to_naive"`
}

// inboxConsumer is one contender of the inbox part.
type inboxConsumer struct {
	name string
	// naive: one autocommit INSERT of the effect per record, no dedupe.
	naive         bool
	checkVersions bool
	maxBatch      int // 0: inboxsarama's default
}

// inboxConsumers: a consumer with no guarantees, the inbox with its
// defaults with and without version checks, and the inbox one record per
// transaction (what inboxsarama did before batches) for comparison.
var inboxConsumers = []inboxConsumer{
	{name: "naive", naive: true},
	{name: "inbox"},
	{name: "inbox, versions", checkVersions: true},
	{name: "inbox, versions, 1 per transaction", checkVersions: true, maxBatch: 1},
}

// inboxPart drains one backlog of relay-shaped records per broker with each
// consumer in turn, the order rotated between repetitions.
func (b *bench) inboxPart(ctx context.Context) ([]InboxResult, error) {
	const db = "bench_inbox"
	dsn, err := b.createDB(ctx, db)
	if err != nil {
		return nil, err
	}
	defer b.dropDB(db)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	ddl, err := inbox.SQL(inbox.Tables{})
	if err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, ddl+`CREATE TABLE effects (event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL)`); err != nil {
		return nil, err
	}
	var out []InboxResult
	for _, br := range b.brokers {
		topic := "bench.inbox." + br.name
		if err := br.createTopic(topic, b.o.partitions); err != nil {
			return out, err
		}
		if err := b.produceInboxBacklog(ctx, br, topic); err != nil {
			return out, fmt.Errorf("inbox, %s: %w", br.name, err)
		}
		for rep := 0; rep < b.o.repeat; rep++ {
			var naive float64
			var reps []InboxResult
			for i := range inboxConsumers {
				c := inboxConsumers[(i+rep)%len(inboxConsumers)]
				if _, err := pool.Exec(ctx, `TRUNCATE effects, inbox_processed, inbox_versions, inbox_parked`); err != nil {
					return out, err
				}
				group := fmt.Sprintf("bench-inbox-%s-%d-%d", br.name, rep, i)
				secs, err := b.drainInbox(ctx, br, pool, topic, group, c)
				if err != nil {
					return out, fmt.Errorf("inbox, %s, %s: %w", br.name, c.name, err)
				}
				r := InboxResult{Broker: br.name, Rep: rep, Consumer: c.name, Events: b.o.inboxEvents, Seconds: secs, EventsPerSec: float64(b.o.inboxEvents) / secs}
				if c.naive {
					naive = r.EventsPerSec
				}
				reps = append(reps, r)
				b.logf("inbox, %s, rep %d, %s: %d events in %.2f s, %.0f events/s", br.name, rep, c.name, r.Events, secs, r.EventsPerSec)
			}
			if naive <= 0 {
				return out, fmt.Errorf("inbox, %s: the naive consumer was not measured", br.name)
			}
			for i := range reps {
				reps[i].RatioToNaive = reps[i].EventsPerSec / naive
			}
			out = append(out, reps...)
		}
	}
	return out, nil
}

// produceInboxBacklog writes the records the relay would publish for
// --inbox-events events over --aggregates aggregates, each aggregate's
// versions counting up from 1.
func (b *bench) produceInboxBacklog(ctx context.Context, br *broker, topic string) error {
	payload := fmt.Appendf(nil, `{"pad": "%0*d"}`, max(b.o.payload-12, 1), 0)
	versions := make(map[int]int64, b.o.aggregates)
	const chunk = 5000
	for done := 0; done < b.o.inboxEvents; done += chunk {
		recs := make([]*kgo.Record, 0, chunk)
		for i := done; i < min(done+chunk, b.o.inboxEvents); i++ {
			agg := i % b.o.aggregates
			versions[agg]++
			aggID := "agg-" + strconv.Itoa(agg)
			recs = append(recs, &kgo.Record{Topic: topic, Key: []byte(aggID), Value: payload, Headers: []kgo.RecordHeader{
				{Key: "event_id", Value: fmt.Appendf(nil, "00000000-0000-7000-8000-%012d", i)},
				{Key: "event_type", Value: []byte("order.updated")},
				{Key: "aggregate_type", Value: []byte("order")},
				{Key: "aggregate_id", Value: []byte(aggID)},
				{Key: "aggregate_version", Value: strconv.AppendInt(nil, versions[agg], 10)},
			}})
		}
		if err := br.cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			return err
		}
	}
	return nil
}

// drainInbox runs one consumer process's worth of consumer group (one
// member) over the topic until every event's effect is committed, and
// returns the seconds that took.
func (b *bench) drainInbox(ctx context.Context, br *broker, pool *pgxpool.Pool, topic, group string, c inboxConsumer) (float64, error) {
	var handled atomic.Int64
	var handler sarama.ConsumerGroupHandler
	if c.naive {
		handler = naiveHandler{pool: pool, handled: &handled}
	} else {
		ib, err := inbox.New(inbox.Config{Consumer: group, CheckVersions: c.checkVersions})
		if err != nil {
			return 0, err
		}
		handler = &inboxsarama.Handler{Inbox: ib, DB: pool, MaxBatch: c.maxBatch,
			Handler: func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
				_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, aggregate_id, version) VALUES ($1, $2, $3)`, ev.ID, ev.AggregateID, ev.Version)
				if err == nil {
					handled.Add(1)
				}
				return err
			}}
	}
	// The group settings inbox.md gives a user, so the bench measures them.
	cfg := inboxsarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	cg, err := inboxsarama.NewConsumerGroup(br.addrs, group, cfg)
	if err != nil {
		return 0, err
	}
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var consumeErr error
	start := time.Now()
	wg.Go(func() {
		for runCtx.Err() == nil {
			if err := cg.Consume(runCtx, []string{topic}, handler); err != nil && runCtx.Err() == nil {
				consumeErr = err
				stop()
			}
		}
	})
	secs, err := waitForEffects(runCtx, pool, &handled, int64(b.o.inboxEvents), start)
	stop()
	wg.Wait()
	cg.Close()
	if consumeErr != nil {
		return 0, consumeErr
	}
	return secs, err
}

// waitForEffects samples until want effects are committed, each once, and
// returns the seconds since start.
func waitForEffects(ctx context.Context, pool *pgxpool.Pool, handled *atomic.Int64, want int64, start time.Time) (float64, error) {
	deadline := time.Now().Add(10 * time.Minute)
	for ctx.Err() == nil && time.Now().Before(deadline) {
		// The handler counts before its batch commits: the drain ends
		// when the effects are committed.
		if handled.Load() >= want {
			var n, distinct int64
			if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM effects`).Scan(&n, &distinct); err != nil {
				return 0, err
			}
			if n > distinct {
				return 0, fmt.Errorf("%d effects applied twice", n-distinct)
			}
			if n >= want {
				return time.Since(start).Seconds(), nil
			}
		}
		time.Sleep(5 * time.Millisecond) // a sampling interval, not synchronisation
	}
	return 0, fmt.Errorf("%d of %d events handled before the drain ended", handled.Load(), want)
}

// naiveHandler inserts each record's effect in its own autocommit
// statement and marks it: no dedupe, no transaction of its own.
type naiveHandler struct {
	pool    *pgxpool.Pool
	handled *atomic.Int64
}

func (naiveHandler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (naiveHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (h naiveHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	for msg := range claim.Messages() {
		var id, agg, version string
		for _, rh := range msg.Headers {
			switch string(rh.Key) {
			case "event_id":
				id = string(rh.Value)
			case "aggregate_id":
				agg = string(rh.Value)
			case "aggregate_version":
				version = string(rh.Value)
			}
		}
		v, _ := strconv.ParseInt(version, 10, 64)
		if _, err := h.pool.Exec(sess.Context(), `INSERT INTO effects (event_id, aggregate_id, version) VALUES ($1, $2, $3)`, id, agg, v); err != nil {
			return err
		}
		h.handled.Add(1)
		sess.MarkMessage(msg, "")
	}
	return nil
}

// inboxTargets adds the inbox part's targets.
func (r *Results) inboxTargets() {
	byBroker := map[string][]InboxResult{}
	for _, x := range r.Inbox {
		byBroker[x.Broker] = append(byBroker[x.Broker], x)
	}
	for br, xs := range byBroker {
		var ratios, rates []float64
		for _, x := range xs {
			if x.Consumer == "inbox" {
				ratios = append(ratios, x.RatioToNaive)
				rates = append(rates, x.EventsPerSec)
			}
		}
		r.target("inbox (defaults) ÷ naive per-record consumer, "+br, "≥ 3", "", ratios, func(v float64) bool { return v >= 3 }, "")
		r.target("inbox (defaults) events/s, "+br, "≥ 15,000", "events/s", rates, func(v float64) bool { return v >= 15000 }, "")
	}
}

// inboxMarkdown is the results section of the inbox part.
func (r *Results) inboxMarkdown(w func(string, ...any)) {
	if len(r.Inbox) == 0 {
		return
	}
	w("\n## Inbox: one consumer process draining a backlog\n\n")
	w("One sarama consumer-group member per contender drains the same backlog of relay-shaped records (%s partitions) into a table of effects, from its first fetch to the last effect committed. naive: one autocommit INSERT per record, no dedupe. inbox: `inboxsarama.Handler` with its defaults (batches), with and without version checks, and one record per transaction. The contenders' order rotates between repetitions. PostgreSQL fsync=%s: with fsync off a naive consumer's commit per record costs next to nothing, so run with `--pg-fsync` to compare as in production.\n\n", r.Settings["partitions"], r.Settings["postgres_fsync"])
	w("| broker | rep | consumer | events | seconds | events/s | ÷ naive |\n|---|---|---|---|---|---|---|\n")
	for _, x := range r.Inbox {
		w("| %s | %d | %s | %d | %.2f | %.0f | %.2f |\n", x.Broker, x.Rep, x.Consumer, x.Events, x.Seconds, x.EventsPerSec, x.RatioToNaive)
	}
}
