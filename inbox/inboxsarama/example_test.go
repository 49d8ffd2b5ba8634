package inboxsarama_test

import (
	"context"
	"errors"
	"log"
	"os"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/inbox/inboxsarama"
)

// A consumer-group member that applies each record through the inbox. The
// offset of a record is marked only after its transaction committed, so a
// crash re-delivers and the inbox skips what was applied already. (Not run:
// it needs a Kafka cluster; the package's test runs the same wiring against
// one.)
func ExampleHandler() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	ib, err := inbox.New(inbox.Config{Consumer: "billing", CheckVersions: true})
	if err != nil {
		log.Fatal(err)
	}
	handler := &inboxsarama.Handler{
		Inbox: ib,
		DB:    pool,
		Handler: func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
			_, err := tx.Exec(ctx, `UPDATE balances SET cents = cents + 100 WHERE account = $1`, ev.AggregateID)
			return err
		},
		OnError: func(msg *sarama.ConsumerMessage, err error) {
			log.Printf("partition %d offset %d: %v (retrying)", msg.Partition, msg.Offset, err)
		},
	}
	// NewConfig keeps the rebalance timeout inside the read timeout, so a
	// member rejoins after another dies; NewConsumerGroup refuses a config
	// that does not.
	cfg := inboxsarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	group, err := inboxsarama.NewConsumerGroup([]string{"localhost:9092"}, "billing", cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer group.Close()
	// A session that ends in an error (a broker restarting, a JoinGroup
	// that timed out) is started again: the committed offsets resume it.
	for ctx.Err() == nil {
		err := group.Consume(ctx, []string{"outbox.event.account"}, handler)
		if errors.Is(err, sarama.ErrClosedConsumerGroup) {
			return
		}
		if err != nil && ctx.Err() == nil {
			log.Printf("consume: %v (joining the group again)", err)
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}
