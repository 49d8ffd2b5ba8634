// Command outbox-relay-demo shows the whole outbox pattern on one machine: it
// starts a private PostgreSQL (wal_level=logical) and an in-process
// Kafka-protocol broker (kfake), runs `outbox-relay migrate` and
// `outbox-relay run`, and then
//
//   - a service commits business rows (orders) and their events in one
//     transaction with package outbox;
//   - the relay publishes them to Kafka;
//   - a consumer, in a database of its own, applies each event to its own
//     table through package inbox (a sarama consumer group);
//   - half-way the relay is SIGKILLed and restarted, so it re-delivers what
//     it had not confirmed yet.
//
// It ends by saying how many re-delivered events the consumer skipped, and
// checks that no effect was applied twice. Everything it starts is removed
// when it ends. `make demo` runs it.
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
	"sync"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/inbox/inboxsarama"
	"github.com/outbox-relay/outbox-relay/internal/throwaway"
	"github.com/outbox-relay/outbox-relay/outbox"
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

// statusInterval is how often the demo's relay confirms its position.
// Longer than the default 1 s, so the crash half-way re-delivers a visible
// tail for the consumer to skip.
const statusInterval = "3s"

// burst is how many changes the service commits at once just before the
// relay is killed.
const burst = 200

func run(ctx context.Context) error {
	relayBin := flag.String("relay", "bin/outbox-relay", "the outbox-relay binary to run (make build)")
	duration := flag.Duration("duration", 12*time.Second, "how long the service keeps writing")
	rate := flag.Int("rate", 20, "business transactions per second")
	flag.Parse()
	bin, err := filepath.Abs(*relayBin)
	if err != nil {
		return err
	}
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("relay binary: %w (run `make build` first, or `make demo`)", err)
	}

	say("starting a private PostgreSQL with wal_level=logical")
	var local throwaway.Services
	defer local.Close()
	pg, err := local.StartPostgres(throwaway.PGOptions{})
	if err != nil {
		return fmt.Errorf("start postgres: %w (the demo runs its own PostgreSQL server: install the server binaries, Debian package postgresql, or point %s at their directory)", err, throwaway.PGBinEnv)
	}
	dsn := pg.DSN("postgres")

	say("starting an in-process Kafka broker (kfake)")
	broker, err := throwaway.StartKfake(throwaway.KfakeOptions{Partitions: 3})
	if err != nil {
		return err
	}
	defer broker.Close()
	brokers := broker.ListenAddrs()

	say("outbox-relay migrate: outbox table, publication, replication slot")
	migrate := exec.CommandContext(ctx, bin, "migrate", "--pg-dsn", dsn)
	migrate.Stdout, migrate.Stderr = os.Stdout, os.Stderr
	if err := migrate.Run(); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, version bigint NOT NULL, status text NOT NULL)`); err != nil {
		return fmt.Errorf("create orders: %w", err)
	}
	consumerDSN, err := consumerDatabase(ctx, conn, pg)
	if err != nil {
		return err
	}

	relay := &relayProcess{bin: bin, args: []string{"run", "--pg-dsn", dsn, "--kafka-brokers", brokers[0],
		"--admin-addr", "", "--status-interval", statusInterval}}
	say("outbox-relay run (confirming every " + statusInterval + ")")
	if err := relay.start(); err != nil {
		return err
	}
	defer relay.stop()

	c, err := startConsumer(ctx, brokers, consumerDSN)
	if err != nil {
		return err
	}
	defer c.stop()

	say(fmt.Sprintf("the service commits %d orders' changes per second for %s, each with its event, through package outbox;", *rate, *duration))
	say("the consumer applies each event to its own table through package inbox, and prints it")
	fmt.Printf("\n%-10s %-8s %-14s %s\n", "ORDER", "VERSION", "EVENT", "EVENT_ID")
	w, err := outbox.New("")
	if err != nil {
		return err
	}
	written := 0
	start := time.Now()
	killed := false
	tick := time.NewTicker(time.Second / time.Duration(max(*rate, 1)))
	defer tick.Stop()
	for time.Since(start) < *duration {
		select {
		case <-ctx.Done():
			return nil
		case err := <-relay.done:
			return fmt.Errorf("relay exited: %v", err)
		case <-tick.C:
		}
		if err := placeOrChange(ctx, conn, w, written); err != nil {
			return err
		}
		written++
		if !killed && time.Since(start) > *duration/2 {
			// A busy moment: the relay is still publishing it when it dies.
			for range burst {
				if err := placeOrChange(ctx, conn, w, written); err != nil {
					return err
				}
				written++
			}
			say(fmt.Sprintf("a burst of %d changes, and SIGKILL the relay while it publishes them; then start it again", burst))
			if err := relay.kill(); err != nil {
				return err
			}
			if err := relay.start(); err != nil {
				return err
			}
			killed = true
		}
	}

	deadline := time.Now().Add(time.Minute)
	for c.applied(ctx) < written {
		if time.Now().After(deadline) {
			return fmt.Errorf("the consumer applied %d of %d events within a minute after writing stopped", c.applied(ctx), written)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(100 * time.Millisecond):
		}
	}
	twice, err := c.appliedTwice(ctx)
	if err != nil {
		return err
	}
	counts := c.metrics.Counts()
	fmt.Println()
	say(fmt.Sprintf("the service committed %d events; the relay was SIGKILLed once and restarted", written))
	say(fmt.Sprintf("the consumer applied %d of them and skipped %d re-delivered events (inbox_duplicates_skipped_total)", counts.Applied, counts.Duplicates+counts.StaleVersions))
	if twice > 0 {
		return fmt.Errorf("%d effects were applied twice", twice)
	}
	say("no effect was applied twice; stopping and cleaning up")
	return nil
}

// consumerDatabase creates the consumer's own database with the inbox's
// tables and the consumer's side-effect table, and returns its DSN.
func consumerDatabase(ctx context.Context, conn *pgx.Conn, pg *throwaway.Postgres) (string, error) {
	if _, err := conn.Exec(ctx, `CREATE DATABASE shipping`); err != nil {
		return "", fmt.Errorf("create the consumer's database: %w", err)
	}
	dsn := pg.DSN("shipping")
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return "", err
	}
	defer c.Close(context.Background())
	ddl, err := inbox.SQL(inbox.Tables{})
	if err != nil {
		return "", err
	}
	if _, err := c.Exec(ctx, ddl+`CREATE TABLE order_log (event_id text NOT NULL, order_id text NOT NULL, version bigint NOT NULL, event_type text NOT NULL)`); err != nil {
		return "", fmt.Errorf("create the consumer's tables: %w", err)
	}
	return dsn, nil
}

var orders = []string{"order-1001", "order-1002", "order-1003", "order-1004"}

var steps = []string{"OrderPlaced", "OrderPaid", "OrderPacked", "OrderShipped"}

// placeOrChange is the service: it moves an order to its next step and
// writes the event in the same transaction.
func placeOrChange(ctx context.Context, conn *pgx.Conn, w *outbox.Writer, n int) error {
	id := orders[rand.IntN(len(orders))]
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	var version int64
	if err := tx.QueryRow(ctx, `INSERT INTO orders VALUES ($1, 1, 'placed')
		ON CONFLICT (id) DO UPDATE SET version = orders.version + 1 RETURNING version`, id).Scan(&version); err != nil {
		return fmt.Errorf("update order: %w", err)
	}
	step := steps[int(version-1)%len(steps)]
	if _, err := w.Write(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: id, EventType: step,
		Payload: fmt.Appendf(nil, `{"seq": %d}`, n), Headers: map[string]string{"tenant": "demo"}, AggregateVersion: version}); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// relayProcess is the relay as a child process that can be killed and
// started again.
type relayProcess struct {
	bin  string
	args []string
	cmd  *exec.Cmd
	done chan error
}

func (r *relayProcess) start() error {
	r.cmd = exec.Command(r.bin, r.args...)
	r.cmd.Stdout, r.cmd.Stderr = nil, nil // the relay's JSON log would drown the demo's lines
	if err := r.cmd.Start(); err != nil {
		return fmt.Errorf("start relay: %w", err)
	}
	r.done = make(chan error, 1)
	cmd, done := r.cmd, r.done
	go func() { done <- cmd.Wait() }()
	return nil
}

func (r *relayProcess) kill() error {
	if err := r.cmd.Process.Kill(); err != nil {
		return fmt.Errorf("kill relay: %w", err)
	}
	<-r.done
	return nil
}

func (r *relayProcess) stop() {
	r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
	case <-time.After(40 * time.Second):
		r.cmd.Process.Kill()
	}
}

// consumer is one member of a sarama consumer group that applies events
// through the inbox.
type consumer struct {
	pool    *pgxpool.Pool
	group   sarama.ConsumerGroup
	metrics *inbox.Metrics
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

func startConsumer(ctx context.Context, brokers []string, dsn string) (*consumer, error) {
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return nil, fmt.Errorf("consumer database: %w", err)
	}
	c := &consumer{pool: pool, metrics: inbox.NewMetrics("shipping")}
	ib, err := inbox.New(inbox.Config{Consumer: "shipping", CheckVersions: true, Metrics: c.metrics})
	if err != nil {
		pool.Close()
		return nil, err
	}
	handler := &inboxsarama.Handler{Inbox: ib, DB: pool, Handler: func(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
		if _, err := tx.Exec(ctx, `INSERT INTO order_log VALUES ($1, $2, $3, $4)`, ev.ID, ev.AggregateID, ev.Version, ev.EventType); err != nil {
			return err
		}
		fmt.Printf("%-10s %-8d %-14s %s\n", ev.AggregateID, ev.Version, ev.EventType, ev.ID)
		return nil
	}}
	cfg := inboxsarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	cfg.Metadata.RefreshFrequency = time.Second // pick up the topic once the relay creates it
	group, err := inboxsarama.NewConsumerGroup(brokers, "shipping", cfg)
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("consumer group: %w", err)
	}
	c.group = group
	runCtx, cancel := context.WithCancel(ctx)
	c.cancel = cancel
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		for runCtx.Err() == nil {
			if err := group.Consume(runCtx, []string{"outbox.event.order"}, handler); err != nil && !errors.Is(err, sarama.ErrClosedConsumerGroup) {
				// The topic does not exist until the relay's first event.
				select {
				case <-runCtx.Done():
				case <-time.After(200 * time.Millisecond):
				}
			}
		}
	}()
	return c, nil
}

func (c *consumer) applied(ctx context.Context) int {
	var n int
	if err := c.pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM order_log`).Scan(&n); err != nil {
		return 0
	}
	return n
}

// appliedTwice counts events whose effect is in the consumer's table more
// than once.
func (c *consumer) appliedTwice(ctx context.Context) (int, error) {
	var n int
	err := c.pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT event_id FROM order_log GROUP BY event_id HAVING count(*) > 1) twice`).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("check the consumer's table: %w", err)
	}
	return n, nil
}

func (c *consumer) stop() {
	c.cancel()
	c.wg.Wait()
	c.group.Close()
	c.pool.Close()
}

func say(msg string) { fmt.Printf("==> %s\n", msg) }
