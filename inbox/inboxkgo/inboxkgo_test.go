package inboxkgo_test

import (
	"context"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/inbox/inboxkgo"
	"github.com/outbox-relay/outbox-relay/inbox/internal/adaptertest"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

var shared harness.SharedPostgres

func TestMain(m *testing.M) { harness.Main(m) }

// The offset of a record is committed only after the record's transaction
// committed: see adaptertest.
func TestOffsetCommittedOnlyAfterTheDatabaseCommit(t *testing.T) {
	adaptertest.OffsetCommittedOnlyAfterTheDatabaseCommit(t, shared.Get(t).CreateTestDatabase(t), adapter)
}

// A record no event can be read from is set aside and its partition goes
// on: see adaptertest.
func TestUnparsableRecordsAreSetAside(t *testing.T) {
	adaptertest.UnparsableRecordsAreSetAside(t, shared.Get(t).CreateTestDatabase(t), adapter)
}

var adapter = adaptertest.Adapter{
	Consume: func(ctx context.Context, t *testing.T, brokers []string, group, topic string,
		ib *inbox.Inbox, db inbox.Beginner, h inbox.Handler, onError func()) {
		cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumerGroup(group), kgo.ConsumeTopics(topic),
			kgo.AutoCommitMarks(), kgo.BlockRebalanceOnPoll(), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
		if err != nil {
			t.Error(err)
			return
		}
		defer cl.Close()
		c := &inboxkgo.Consumer{Client: cl, Inbox: ib, DB: db, Handler: h, CommitEach: true,
			OnError: func(*kgo.Record, error) { onError() }}
		if err := c.Run(ctx); err != nil {
			t.Errorf("run: %v", err)
		}
	},
}
