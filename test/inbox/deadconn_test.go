package inboxdrills

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// TestDrillConsumerKafkaBlackHole black-holes every connection between an
// inbox consumer and Apache Kafka (toxiproxy in front of the broker, whose
// client listener advertises the proxy) for 20 s while a writer produces
// versions of 40 aggregates at a steady pace past the proxy, with each
// adapter and the settings docs/inbox.md gives. The consumer must take the
// connections for dead, join its group again once the network heals, and
// apply every event once, in order: no loss, no effect twice.
func TestDrillConsumerKafkaBlackHole(t *testing.T) {
	for _, name := range []string{"inboxsarama", "inboxkgo"} {
		t.Run(name, func(t *testing.T) {
			w := newWorldOn(t, 3, harness.ApacheKafkaOptions{Proxied: true})
			toxi := w.k.Toxi(0)
			t.Cleanup(func() { toxi.Heal(t) })
			const rounds = 120 // 100 ms apart: 12 s, then the rest after the heal
			var aggs []string
			start, last := map[string]int{}, map[string]int{}
			for i := range 40 {
				agg := fmt.Sprintf("acct-%03d", i)
				aggs = append(aggs, agg)
				start[agg], last[agg] = 1, rounds
			}
			ib, err := inbox.New(inbox.Config{Consumer: "billing", CheckVersions: true})
			if err != nil {
				t.Fatal(err)
			}
			ended := make(chan error, 1)
			run := func(ctx context.Context, w *world, group string, ib *inbox.Inbox, h inbox.Handler) error {
				err := adapters[name](ctx, w, group, ib, h)
				ended <- err
				return err
			}
			stop := w.members(1, run, "billing", ib, effect)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			holed := make(chan struct{})
			var writeErr error
			var writer sync.WaitGroup
			writer.Go(func() {
				writeErr = w.write(ctx, rounds, 100*time.Millisecond, w.versionsOf(aggs, start, nil), func(round int) {
					if round == 40 {
						close(holed)
					}
				})
			})
			<-holed
			applied := w.db.QueryInt64(t, `SELECT count(*) FROM effects`)
			if applied == 0 {
				t.Fatal("nothing applied before the black hole: the drill would prove nothing")
			}
			toxi.BlackHole(t)
			holeStart := time.Now()
			harness.WaitFor(t, time.Minute, "20 s of black hole", func() bool { return time.Since(holeStart) >= 20*time.Second })
			during := w.db.QueryInt64(t, `SELECT count(*) FROM effects`)
			toxi.Heal(t)
			healed := time.Now()
			harness.WaitFor(t, 2*time.Minute, "the consumer applies again", func() bool {
				select {
				case err := <-ended:
					t.Fatalf("the consumer stopped after the black hole: %v", err)
				default:
				}
				return w.db.QueryInt64(t, `SELECT count(*) FROM effects`) > during+40
			})
			again := time.Since(healed)
			writer.Wait()
			if writeErr != nil {
				t.Fatal(writeErr)
			}
			harness.WaitFor(t, 3*time.Minute, "the group catches up", func() bool { return w.caughtUp("billing") })
			if err := stop(); err != nil {
				t.Fatalf("consumer: %v", err)
			}
			w.checkApplied(last, nil)
			t.Logf("%s: %d effects before the black hole, %d when it healed; applying again %v after the heal; all %d events applied once, in order",
				name, applied, during, again.Round(100*time.Millisecond), rounds*len(aggs))
		})
	}
}

// effect records the event's effect.
func effect(ctx context.Context, tx pgx.Tx, ev inbox.Event) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, aggregate_id, version) VALUES ($1, $2, $3)`, ev.ID, ev.AggregateID, ev.Version)
	return err
}
