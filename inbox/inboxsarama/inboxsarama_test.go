package inboxsarama_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/inbox/inboxsarama"
	"github.com/outbox-relay/outbox-relay/inbox/internal/adaptertest"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

var shared harness.SharedPostgres

func TestMain(m *testing.M) { harness.Main(m) }

// The offset of a record is committed only after the record's transaction
// committed: see adaptertest. Once with one record per transaction
// (MaxBatch 1), once in batches (the default).
func TestOffsetCommittedOnlyAfterTheDatabaseCommit(t *testing.T) {
	for _, maxBatch := range []int{1, 0} {
		t.Run(fmt.Sprintf("MaxBatch=%d", maxBatch), func(t *testing.T) {
			adaptertest.OffsetCommittedOnlyAfterTheDatabaseCommit(t, shared.Get(t).CreateTestDatabase(t), adapter(maxBatch))
		})
	}
}

// A record no event can be read from is set aside and its partition goes
// on: see adaptertest.
func TestUnparsableRecordsAreSetAside(t *testing.T) {
	for _, maxBatch := range []int{1, 0} {
		t.Run(fmt.Sprintf("MaxBatch=%d", maxBatch), func(t *testing.T) {
			adaptertest.UnparsableRecordsAreSetAside(t, shared.Get(t).CreateTestDatabase(t), adapter(maxBatch))
		})
	}
}

// A Handler without its DB or Inbox panicked on the first record (issue
// 55, item 6). Now the group's Consume returns an error naming what is
// missing, before any record is read.
func TestHandlerWithoutDBOrInboxSaysSo(t *testing.T) {
	k := harness.StartKfake(t)
	const topic = "outbox.event.account"
	k.CreateTopic(t, topic, 1, nil)
	rec := &kgo.Record{Topic: topic, Key: []byte("a"), Value: []byte(`{}`), Headers: []kgo.RecordHeader{{Key: "event_id", Value: []byte("e1")}}}
	if err := k.Client(t).ProduceSync(context.Background(), rec).FirstErr(); err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	h := func(context.Context, pgx.Tx, inbox.Event) error { return nil }
	for name, handler := range map[string]*inboxsarama.Handler{
		"no DB":    {Inbox: ib, Handler: h},
		"no Inbox": {DB: &pgxpool.Pool{}, Handler: h},
		// A hostile try: a pool variable never opened passed Setup and
		// panicked in sarama's goroutine on the first record.
		"a nil pool": {Inbox: ib, DB: (*pgxpool.Pool)(nil), Handler: h},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := inboxsarama.NewConfig()
			cfg.Version = sarama.V3_6_0_0
			cg, err := inboxsarama.NewConsumerGroup(k.Brokers(), "billing", cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer cg.Close()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err = cg.Consume(ctx, []string{topic}, handler)
			if err == nil || !strings.Contains(err.Error(), "Inbox, DB and Handler must all be set") {
				t.Fatalf("Consume: %v, want an error naming what is missing", err)
			}
		})
	}
}

func adapter(maxBatch int) adaptertest.Adapter {
	return adaptertest.Adapter{
		OneByOne: maxBatch == 1,
		Consume: func(ctx context.Context, t *testing.T, brokers []string, group, topic string,
			ib *inbox.Inbox, db inbox.Beginner, h inbox.Handler, onError func()) {
			handler := &inboxsarama.Handler{Inbox: ib, DB: db, Handler: h, CommitEach: true, MaxBatch: maxBatch,
				OnError: func(*sarama.ConsumerMessage, error) { onError() }}
			cfg := inboxsarama.NewConfig()
			cfg.Version = sarama.V3_6_0_0
			cg, err := inboxsarama.NewConsumerGroup(brokers, group, cfg)
			if err != nil {
				t.Error(err)
				return
			}
			defer cg.Close()
			for ctx.Err() == nil {
				if err := cg.Consume(ctx, []string{topic}, handler); err != nil && ctx.Err() == nil {
					t.Errorf("consume: %v", err)
					return
				}
			}
		},
	}
}
