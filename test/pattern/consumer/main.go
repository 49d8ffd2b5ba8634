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
	"hash/fnv"
	"os"
	"os/signal"
	"strings"
	"sync"
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
	failEvery := flag.Uint("fail-first-attempt-every", 0, "make the handler's first attempt at one event in N fail (chosen by event_id), to drive a failure into the middle of a batch; 0: never")
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
	failures := &injectedFailures{every: uint32(*failEvery), failed: map[string]bool{}}
	handler := &inboxsarama.Handler{
		Inbox: ib, DB: pool, RetryMax: 500 * time.Millisecond,
		Handler: func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
			if failures.first(ev.ID) {
				return errors.New("injected failure")
			}
			_, err := tx.Exec(ctx, `INSERT INTO effects (consumer, event_id, aggregate_id, version, pid)
				VALUES ($1, $2, $3, $4, $5)`, *group, ev.ID, ev.AggregateID, ev.Version, os.Getpid())
			return err
		},
	}

	// The group settings are the ones docs/inbox.md gives users; the
	// drill changes only what that page leaves to the service: how soon
	// a killed member's partitions move (its session timeout) and how
	// often marked offsets are committed.
	cfg := inboxsarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	cfg.Consumer.Offsets.AutoCommit.Interval = 200 * time.Millisecond
	cfg.Consumer.Group.Session.Timeout = 6 * time.Second
	cfg.Consumer.Group.Heartbeat.Interval = time.Second
	if *readCommitted {
		cfg.Consumer.IsolationLevel = sarama.ReadCommitted
	}
	cg, err := inboxsarama.NewConsumerGroup(strings.Split(*brokers, ","), *group, cfg)
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
				_ = enc.Encode(counts{metrics.Counts(), failures.count()})
			}
		}
	}()
	// As docs/inbox.md's loop does, a session that ends in an error is
	// started again: a broker that restarts or a fetch that times out on
	// a loaded broker is no reason for a service to exit, and the offsets
	// make it resume where the last commit left it. Only a closed group
	// ends it.
	for ctx.Err() == nil && err == nil {
		err = cg.Consume(ctx, []string{*topic}, handler)
		switch {
		case ctx.Err() != nil:
			err = nil
		case err != nil && !errors.Is(err, sarama.ErrClosedConsumerGroup):
			fmt.Fprintf(os.Stderr, "consume: %v; joining the group again\n", err)
			err = nil
			select {
			case <-ctx.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	stop()
	<-printed
	_ = enc.Encode(counts{metrics.Counts(), failures.count()}) // the last word of a life that was not killed
	if err != nil {
		return fmt.Errorf("consume: %w", err)
	}
	return nil
}

// counts is a counter line: the inbox's counters and the failures injected.
type counts struct {
	inbox.Counts
	InjectedFailures int64
}

// injectedFailures fails the first attempt at one event in every, in this
// process. An attempt inside a batch that the failure rolls back is the
// first; the inbox then applies the batch one event at a time, and the
// second attempt succeeds, so the failure is absorbed without reaching
// the handler's error count.
type injectedFailures struct {
	every  uint32
	mu     sync.Mutex
	failed map[string]bool
}

func (f *injectedFailures) first(eventID string) bool {
	if f.every == 0 {
		return false
	}
	h := fnv.New32a()
	h.Write([]byte(eventID))
	if h.Sum32()%f.every != 0 {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failed[eventID] {
		return false
	}
	f.failed[eventID] = true
	return true
}

func (f *injectedFailures) count() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return int64(len(f.failed))
}
