package publisher

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// The contract the read loop relies on, run against both sinks on kfake:
// what each must do with records, source transaction ends, flushes, close
// and failures. Where the two differ, the difference is part of the
// contract: a transactional sink holds acks until its commit and reports
// each Kafka transaction's end; a record-by-record one acks at once and
// ignores ends and flushes.
func TestSinkContract(t *testing.T) {
	for _, kind := range []struct {
		name          string
		transactional bool
		start         func(t *testing.T, cfg Config) sink.Sink
	}{
		{"at-least-once", false, func(t *testing.T, cfg Config) sink.Sink {
			p, err := New(cfg, zerolog.Nop())
			if err != nil {
				t.Fatal(err)
			}
			return p
		}},
		{"exactly-once", true, func(t *testing.T, cfg Config) sink.Sink {
			tcfg := DefaultTxnConfig()
			tcfg.TransactionalID = "contract-" + t.Name()
			tcfg.Interval = time.Hour // only ends past the batch size and flushes commit
			tcfg.BatchEvents = 4
			s, err := NewTxnSink(cfg, tcfg, zerolog.Nop())
			if err != nil {
				t.Fatal(err)
			}
			return s
		}},
	} {
		t.Run(kind.name, func(t *testing.T) {
			k := harness.StartKfake(t)
			w := newTxnWorld(t, k.Brokers())
			start := func(t *testing.T) *driver { return drive(t, kind.start(t, w.cfg)) }
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()

			t.Run("every record once, acked after its Kafka transaction", func(t *testing.T) {
				d := start(t)
				txns := makeTxns("contract", 6, 3, 4) // 1+2+3+1+2+3 events
				if _, err := d.stream(ctx, txns[:2], nil); err != nil {
					t.Fatal(err)
				}
				// Three records: below the batch size, so a transactional
				// sink holds them; the other acks them as Kafka stores them.
				if kind.transactional {
					if harness.Poll(200*time.Millisecond, func() bool { a, f := d.counts(); return a+f > 0 }) {
						t.Fatal("an outcome before the Kafka transaction committed")
					}
				} else {
					d.waitFor(10*time.Second, "acks without a commit", func() bool { return len(d.acked) == 3 })
				}
				if _, err := d.stream(ctx, txns[2:], nil); err != nil {
					t.Fatal(err)
				}
				if err := d.settle(ctx); err != nil {
					t.Fatal(err)
				}
				perTxn := map[uint64]int{}
				d.mu.Lock()
				for _, a := range d.acked {
					perTxn[a.Txn]++
				}
				reports := append([]sink.TxnReport(nil), d.reports...)
				d.mu.Unlock()
				for _, st := range txns {
					if perTxn[uint64(st.id)] != len(st.events) {
						t.Fatalf("source transaction %d: %d acks, want one for each of its %d records", st.id, perTxn[uint64(st.id)], len(st.events))
					}
				}
				consumeExactlyOnce(t, k.Brokers(), "contract.order", eventIDs(txns))
				switch {
				case !kind.transactional && len(reports) != 0:
					t.Fatalf("a record-by-record sink reported Kafka transactions: %+v", reports)
				case kind.transactional && (len(reports) == 0 || reports[len(reports)-1].End != txns[len(txns)-1].end):
					t.Fatalf("reports %+v: want the last one committing up to %v", reports, txns[len(txns)-1].end)
				}
			})

			t.Run("a flush commits inside a source transaction", func(t *testing.T) {
				d := start(t)
				txn := makeTxns("contractflush", 3, 3, 2)[2] // 3 events, its end not sent
				for _, ev := range txn.events {
					r, err := d.build(ctx, ev)
					if err != nil {
						t.Fatal(err)
					}
					if err := d.send(ctx, r); err != nil {
						t.Fatal(err)
					}
				}
				if err := d.settle(ctx); err != nil {
					t.Fatal(err)
				}
				if kind.transactional {
					// The commit's report may follow the acks that settle
					// waited for: a CI run under load read it too early.
					d.waitFor(10*time.Second, "the split commit's reports", func() bool {
						st := d.statsLocked()
						return st.split >= 1 && st.committed >= 1
					})
				}
				st := d.stats()
				if kind.transactional && (st.split != 1 || st.committed != 1 || st.lastCommitted != 0) {
					t.Fatalf("%v: want one split commit with no progress", st)
				}
				if !kind.transactional && st != (txnStats{}) {
					t.Fatalf("%v: a record-by-record sink reports no transactions", st)
				}
			})

			t.Run("Close ends Outcomes", func(t *testing.T) {
				s := kind.start(t, w.cfg)
				if err := s.Close(10 * time.Second); err != nil {
					t.Fatalf("close with nothing in flight: %v", err)
				}
				select {
				case _, open := <-s.Outcomes():
					if open {
						t.Fatal("an outcome from a sink that was given nothing")
					}
				case <-time.After(10 * time.Second):
					t.Fatal("Outcomes still open after Close")
				}
			})

			t.Run("failures name their class", func(t *testing.T) {
				if kind.transactional {
					skipSaramaTxnErrorRace(t)
				}
				d := start(t)
				k.CreateTopic(t, "contractfail.order", 1, nil)
				txns := makeTxns("contractfail", 2, 2, 1) // 1 and 2 events
				poison := txns[1].events[1].EventID
				refusal := k.RefuseRecordsWith(poison, kerr.InvalidRecord.Code)
				defer refusal.Remove()
				if _, err := d.stream(ctx, txns, nil); err != nil {
					t.Fatal(err)
				}
				err := d.settle(ctx)
				var perr *sink.Error
				if !errors.As(err, &perr) {
					t.Fatalf("settled with %v, want a failed record", err)
				}
				if kind.transactional {
					// One refusal aborts the Kafka transaction: every record
					// of it fails, retriable, to be re-streamed, and the
					// sink is spent.
					acked, failed := d.counts()
					if acked != 0 || failed != 3 || perr.Class != sink.ClassRetriable || !errors.Is(perr, ErrTxnAborted) || perr.Partition != -1 {
						t.Fatalf("%d acked, %d failed, first %v (class %s); want all 3 failed as an aborted transaction", acked, failed, perr, perr.Class)
					}
					if _, err := d.stream(ctx, makeTxns("contractfail-after", 1, 1, 1), nil); err != nil {
						t.Fatal(err)
					}
					if err := d.settle(ctx); !errors.Is(err, ErrTxnAborted) {
						t.Fatalf("a spent sink answered %v for a new record, want ErrTxnAborted", err)
					}
				} else {
					// Kafka refused that record, and its request's other
					// records with it: permanent, named by event.
					for _, f := range d.failures() {
						if f.Class != sink.ClassPermanent {
							t.Fatalf("failure %v as %s, want permanent", f, f.Class)
						}
					}
					if perr.EventID == "" || perr.Partition < 0 {
						t.Fatalf("failure %+v names no event or partition", perr)
					}
				}
				if refusal.Hits() == 0 {
					t.Fatal("the broker never saw the refused record: the test proves nothing")
				}
			})

			t.Run("a topic Kafka cannot have is refused at Build", func(t *testing.T) {
				d := start(t)
				ev := makeTxns("contractbad", 1, 1, 1)[0].events[0]
				ev.AggregateType = []byte("no such/topic")
				_, err := d.build(ctx, ev)
				var perr *sink.Error
				if !errors.As(err, &perr) || perr.Class != sink.ClassPermanent || perr.EventID != string(ev.EventID) {
					t.Fatalf("Build for an invalid topic: %v, want a permanent error naming the event", err)
				}
			})
		})
	}
}
