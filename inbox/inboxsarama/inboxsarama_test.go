package inboxsarama_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/IBM/sarama"

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
			adaptertest.OffsetCommittedOnlyAfterTheDatabaseCommit(t, shared.Get(t).CreateTestDatabase(t), adaptertest.Adapter{
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
			})
		})
	}
}
