// Command outbox-relay-demo shows the relay working end to end on one
// machine: it starts a private PostgreSQL (wal_level=logical) and an
// in-process Kafka-protocol broker (kfake), runs `outbox-relay migrate` and
// `outbox-relay run`, commits sample events the way a service would, and
// prints each record as a plain Kafka consumer (franz-go) reads it back.
// Everything it starts is removed when it ends. `make demo` runs it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "demo: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	relayBin := flag.String("relay", "bin/outbox-relay", "the outbox-relay binary to run (make build)")
	duration := flag.Duration("duration", 15*time.Second, "how long to keep writing events")
	rate := flag.Int("rate", 10, "events per second to write")
	flag.Parse()
	bin, err := filepath.Abs(*relayBin)
	if err != nil {
		return err
	}
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("relay binary: %w (run `make build` first, or `make demo`)", err)
	}

	say("starting a private PostgreSQL with wal_level=logical")
	pg, stopPG, err := harness.StartPostgresMain(harness.PGOptions{})
	if err != nil {
		return fmt.Errorf("start postgres: %w (the demo runs its own PostgreSQL server: install the server binaries, Debian package postgresql, or point %s at their directory)", err, harness.PGBinEnv)
	}
	defer stopPG()
	dsn := pg.DSN("postgres")

	say("starting an in-process Kafka broker (kfake)")
	broker, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(3))
	if err != nil {
		return fmt.Errorf("start kfake: %w", err)
	}
	defer broker.Close()
	brokers := broker.ListenAddrs()

	say("outbox-relay migrate: outbox table, publication, replication slot")
	migrate := exec.CommandContext(ctx, bin, "migrate", "--pg-dsn", dsn)
	migrate.Stdout, migrate.Stderr = os.Stdout, os.Stderr
	if err := migrate.Run(); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}

	say("outbox-relay run")
	relay := exec.Command(bin, "run", "--pg-dsn", dsn, "--kafka-brokers", brokers[0], "--admin-addr", "127.0.0.1:0")
	relay.Stdout, relay.Stderr = os.Stderr, os.Stderr
	if err := relay.Start(); err != nil {
		return fmt.Errorf("start relay: %w", err)
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Wait() }()
	defer func() {
		relay.Process.Signal(syscall.SIGTERM)
		select {
		case <-relayDone:
		case <-time.After(40 * time.Second):
			relay.Process.Kill()
		}
	}()

	consumer, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeRegex(), kgo.ConsumeTopics(`^outbox\.event\.`),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.MetadataMinAge(100*time.Millisecond), kgo.MetadataMaxAge(time.Second))
	if err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	defer consumer.Close()

	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.Background())

	say(fmt.Sprintf("a service commits %d events/s for %s; a plain Kafka consumer prints what arrives", *rate, *duration))
	fmt.Printf("\n%-22s %-4s %-12s %-36s %s\n", "TOPIC", "PART", "KEY", "EVENT_ID", "EVENT_TYPE")
	written, read := 0, 0
	writeUntil := time.Now().Add(*duration)
	tick := time.NewTicker(time.Second / time.Duration(max(*rate, 1)))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-relayDone:
			return fmt.Errorf("relay exited: %v", err)
		case <-tick.C:
		}
		if time.Now().Before(writeUntil) {
			if err := writeEvent(ctx, conn, written); err != nil {
				return err
			}
			written++
		}
		pollCtx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		fetches := consumer.PollFetches(pollCtx)
		cancel()
		fetches.EachRecord(func(r *kgo.Record) {
			read++
			fmt.Printf("%-22s %-4d %-12s %-36s %s\n", r.Topic, r.Partition, r.Key, header(r, "event_id"), header(r, "event_type"))
		})
		if !time.Now().Before(writeUntil) && read >= written {
			say(fmt.Sprintf("all %d committed events arrived in Kafka; stopping and cleaning up", written))
			return nil
		}
		if time.Now().After(writeUntil.Add(time.Minute)) {
			return errors.New("events did not all arrive within a minute after writing stopped")
		}
	}
}

var aggregates = []struct{ kind, id string }{
	{"order", "order-1001"}, {"order", "order-1002"}, {"customer", "cust-7"}, {"invoice", "inv-42"},
}

var eventTypes = map[string][]string{
	"order":    {"OrderPlaced", "OrderPaid", "OrderShipped"},
	"customer": {"CustomerRegistered", "AddressChanged"},
	"invoice":  {"InvoiceIssued", "InvoicePaid"},
}

// writeEvent commits a business change and its outbox row in one
// transaction, as a service using the outbox pattern does.
func writeEvent(ctx context.Context, conn *pgx.Conn, n int) error {
	agg := aggregates[rand.IntN(len(aggregates))]
	types := eventTypes[agg.kind]
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, `INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
		VALUES (gen_random_uuid(), $1, $2, $3, jsonb_build_object('seq', $4::int), '{"tenant": "demo"}')`,
		agg.kind, agg.id, types[n%len(types)], n)
	if err != nil {
		return fmt.Errorf("insert event: %w", err)
	}
	return tx.Commit(ctx)
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func say(msg string) { fmt.Printf("==> %s\n", msg) }
