// Command consumer is the drills' consumer process: it applies the relay's
// records to a side-effect table through the inbox, as one member of a
// sarama consumer group, and prints its counters as a JSON line every
// --stats-interval, so a test that SIGKILLs it still knows what each life
// counted up to its last line.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/inbox/inboxsarama"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

func run() error {
	brokers := flag.String("brokers", "", "Kafka brokers, comma-separated")
	dsn := flag.String("dsn", "", "PostgreSQL connection string of the consumer's database")
	group := flag.String("group", "", "consumer group, also the inbox's consumer name")
	topic := flag.String("topic", "", "topic to consume")
	readCommitted := flag.Bool("read-committed", false, "read with isolation.level=read_committed")
	statsEvery := flag.Duration("stats-interval", 100*time.Millisecond, "how often to print the counters")
	flag.Parse()
	if *brokers == "" || *dsn == "" || *group == "" || *topic == "" {
		return errors.New("--brokers, --dsn, --group and --topic are required")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	pool, err := pgxpool.New(ctx, *dsn)
	if err != nil {
		return fmt.Errorf("database: %w", err)
	}
	defer pool.Close()
	metrics := inbox.NewMetrics(*group)
	ib, err := inbox.New(inbox.Config{Consumer: *group, CheckVersions: true, Metrics: metrics})
	if err != nil {
		return err
	}
	handler := &inboxsarama.Handler{
		Inbox: ib, DB: pool, RetryMax: 500 * time.Millisecond,
		Handler: func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (consumer, event_id, aggregate_id, version, pid)
				VALUES ($1, $2, $3, $4, $5)`, *group, ev.ID, ev.AggregateID, ev.Version, os.Getpid())
			return err
		},
	}

	cfg := sarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	cfg.Consumer.Offsets.AutoCommit.Interval = 200 * time.Millisecond
	// A killed member holds its partitions until its session times out.
	cfg.Consumer.Group.Session.Timeout = 6 * time.Second
	cfg.Consumer.Group.Heartbeat.Interval = time.Second
	if *readCommitted {
		cfg.Consumer.IsolationLevel = sarama.ReadCommitted
	}
	cg, err := sarama.NewConsumerGroup(strings.Split(*brokers, ","), *group, cfg)
	if err != nil {
		return fmt.Errorf("consumer group: %w", err)
	}
	defer cg.Close()

	enc := json.NewEncoder(os.Stdout)
	printed := make(chan struct{})
	go func() {
		defer close(printed)
		t := time.NewTicker(*statsEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				_ = enc.Encode(metrics.Counts())
			}
		}
	}()
	for ctx.Err() == nil && err == nil {
		if err = cg.Consume(ctx, []string{*topic}, handler); ctx.Err() != nil {
			err = nil
		}
	}
	stop()
	<-printed
	_ = enc.Encode(metrics.Counts()) // the last word of a life that was not killed
	if err != nil {
		return fmt.Errorf("consume: %w", err)
	}
	return nil
}
