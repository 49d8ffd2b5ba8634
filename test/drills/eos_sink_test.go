package drills

// The exactly-once sink (publisher.TxnPublisher) against every broker kind:
// a stream of source transactions with their progress records, read back
// with read_committed exactly once and whole, and a fenced sink that must
// report ErrFenced and never commit again.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// skipSaramaTxnErrorRace skips a test that drives sarama's transactional
// producer into an error state with records in flight when the race
// detector is on: sarama v1.61.1 reads transactionManager.lastError
// without a lock (transaction_manager.go:884) while transitionTo writes it
// (line 249), IBM/sarama #2913 and #2915. The Makefile runs such tests
// without -race (test-norace).
func skipSaramaTxnErrorRace(t *testing.T) {
	t.Helper()
	if raceEnabled {
		t.Skip("sarama data race on its transactional error path (IBM/sarama #2913, #2915): make test-norace runs this without -race")
	}
}

// eosOutcomes counts a sink's outcomes.
type eosOutcomes struct {
	acked, failed chan *publisher.Error
}

func newEOSOutcomes() *eosOutcomes {
	return &eosOutcomes{acked: make(chan *publisher.Error, 100000), failed: make(chan *publisher.Error, 100000)}
}

func (o *eosOutcomes) Acked(publisher.Delivery)                          { o.acked <- nil }
func (o *eosOutcomes) Failed(_ publisher.Delivery, err *publisher.Error) { o.failed <- err }

func newEOSSink(t *testing.T, brokers []string, id, progressTopic string, h publisher.Handler) *publisher.TxnPublisher {
	t.Helper()
	cfg := publisher.DefaultConfig()
	cfg.Brokers = brokers
	cfg.TopicTemplate = "{aggregate_type}"
	tcfg := publisher.DefaultTxnConfig()
	tcfg.TransactionalID = id
	tcfg.Interval = 20 * time.Millisecond
	tcfg.BatchEvents = 50 // many Kafka transactions per test
	tcfg.Progress = func(_ lsn.TxnID, end lsn.LSN, _ time.Time) (publisher.ProgressRecord, error) {
		return publisher.ProgressRecord{Topic: progressTopic, Key: []byte(id), Value: []byte(end.String())}, nil
	}
	s, err := publisher.NewTxn(cfg, tcfg, h, zerolog.Nop())
	if err != nil {
		t.Fatalf("new exactly-once sink: %v", err)
	}
	return s
}

// eosStream sends source transactions first..first+n-1 of topic, each of
// 1 to 4 events, and returns their event ids.
func eosStream(ctx context.Context, s *publisher.TxnPublisher, topic string, first, n int) ([]string, error) {
	var sent []string
	for i := first; i < first+n; i++ {
		for j := range i%4 + 1 {
			id := fmt.Sprintf("%s-%d-%d", topic, i, j)
			ev := &publisher.Event{
				EventID: []byte(id), AggregateType: []byte(topic), AggregateID: []byte("agg-" + strconv.Itoa((i+j)%13)),
				EventType: []byte("Happened"), SchemaVersion: []byte("1"), Payload: []byte(`{}`),
				OccurredAt: []byte("2026-12-01 03:00:00+00"), Txn: uint64(i),
			}
			r, err := s.BuildWait(ctx, ev)
			if err != nil {
				return sent, err
			}
			if err := s.Send(ctx, r); err != nil {
				return sent, err
			}
			sent = append(sent, id)
		}
		if err := s.EndTxn(ctx, lsn.TxnID(i), lsn.LSN(i*100), time.Now()); err != nil {
			return sent, err
		}
	}
	return sent, nil
}

func TestEOSSink(t *testing.T) {
	for _, kind := range eosBrokerKinds() {
		t.Run(kind.name, func(t *testing.T) {
			b := kind.start(t)
			ctx := context.Background()

			t.Run("stream-with-progress", func(t *testing.T) {
				topic, progress := "eos_sink_stream", "eos_sink_stream_progress"
				b.createTopic(t, topic, 3)
				b.createTopic(t, progress, 1)
				out := newEOSOutcomes()
				s := newEOSSink(t, b.brokers, "eos-sink-"+b.name, progress, out)
				sent, err := eosStream(ctx, s, topic, 1, 200)
				if err != nil {
					t.Fatalf("stream: %v", err)
				}
				if err := s.Close(30 * time.Second); err != nil {
					t.Fatalf("close: %v", err)
				}
				if len(out.acked) != len(sent) || len(out.failed) != 0 {
					t.Fatalf("%d acked, %d failed of %d sent", len(out.acked), len(out.failed), len(sent))
				}
				checkCommitted(t, b.brokers, topic, sent)
				st := s.Stats()
				if st.LastCommitted != lsn.LSN(200*100) || st.Aborted != 0 || st.Committed < 10 {
					t.Fatalf("stats %+v", st)
				}
				last := lsn.LSN(200 * 100).String()
				harness.ConsumeUntil(t, b.brokers, "^"+progress+"$", 30*time.Second, func(all []harness.Record) bool {
					return len(all) > 0 && string(all[len(all)-1].Value) == last
				})
				t.Logf("%s: %d events in %d Kafka transactions", b.name, len(sent), st.Committed)
			})

			t.Run("poison", func(t *testing.T) {
				skipSaramaTxnErrorRace(t)
				eosPoisonDrill(t, b)
			})

			t.Run("fenced", func(t *testing.T) {
				skipSaramaTxnErrorRace(t)
				topic, progress := "eos_sink_fence", "eos_sink_fence_progress"
				b.createTopic(t, topic, 2)
				b.createTopic(t, progress, 1)
				id := "eos-sink-fence-" + b.name
				oldOut := newEOSOutcomes()
				old := newEOSSink(t, b.brokers, id, progress, oldOut)
				defer old.Close(10 * time.Second)
				before, err := eosStream(ctx, old, topic, 1, 5)
				if err == nil {
					err = old.Commit(ctx)
				}
				if err != nil {
					t.Fatalf("before the fence: %v", err)
				}
				newer := newEOSSink(t, b.brokers, id, progress, newEOSOutcomes())
				defer newer.Close(10 * time.Second)
				_, err = eosStream(ctx, old, topic, 6, 3)
				if err == nil {
					err = old.Commit(ctx)
				}
				if !errors.Is(err, publisher.ErrFenced) {
					t.Fatalf("old sink after the fence: %v, want ErrFenced", err)
				}
				for len(oldOut.failed) > 0 {
					if f := <-oldOut.failed; f.Class != publisher.ClassFenced {
						t.Fatalf("failure class %s, want %s", f.Class, publisher.ClassFenced)
					}
				}
				after, err := eosStream(ctx, newer, topic, 9, 3)
				if err == nil {
					err = newer.Commit(ctx)
				}
				if err != nil {
					t.Fatalf("newer sink: %v", err)
				}
				if st := old.Stats(); st.Committed != 1 {
					t.Fatalf("fenced sink committed %d times, want the 1 before the fence", st.Committed)
				}
				checkCommitted(t, b.brokers, topic, append(before, after...))
			})
		})
	}
}

// eosEvent is one outbox event of eosStream's shape with a payload of
// size bytes.
func eosEvent(topic, id string, txn int, size int) *publisher.Event {
	payload := make([]byte, size)
	for i := range payload {
		payload[i] = 'p'
	}
	payload[0], payload[size-1] = '"', '"'
	return &publisher.Event{
		EventID: []byte(id), AggregateType: []byte(topic), AggregateID: []byte("agg-" + strconv.Itoa(txn%5)),
		EventType: []byte("Happened"), SchemaVersion: []byte("1"), Payload: payload,
		OccurredAt: []byte("2026-12-01 03:00:00+00"), Txn: uint64(txn),
	}
}

// setTopicConfig alters one config of a topic through the admin API.
func setTopicConfig(t *testing.T, brokers []string, topic, name, value string) {
	t.Helper()
	adm := kadm.NewClient(harness.NewKgoClient(t, brokers))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := adm.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Op: kadm.SetConfig, Name: name, Value: &value}}, topic)
	if err == nil {
		_, err = resp.On(topic, nil)
	}
	if err != nil {
		t.Fatalf("set %s=%s on %s: %v", name, value, topic, err)
	}
}

// A poison event inside a multi-event source transaction, refused by the
// broker itself: the topic's max.message.bytes was lowered after the
// relay checked it, so the pre-send size check let the record through. The
// Kafka transaction aborts; the re-stream learns the new limit (the
// producer restarts with smaller batches, as the relay does on a
// BatchLimitError), the size check now rejects the poison once, and every
// other event commits exactly once.
func eosPoisonDrill(t *testing.T, b eosBroker) {
	topic := "eos_sink_poison"
	b.createTopic(t, topic, 1)
	var txns [][]*publisher.Event
	for i := range 4 {
		var evs []*publisher.Event
		for j := range 3 {
			size := 100
			if i == 2 && j == 1 {
				size = 200000
			}
			evs = append(evs, eosEvent(topic, fmt.Sprintf("%s-%d-%d", topic, i, j), i+1, size))
		}
		txns = append(txns, evs)
	}
	poison := string(txns[2][1].EventID)
	maxBytes := 500000

	ctx := context.Background()
	var quarantined []string
	var committed lsn.LSN
	lowered := false
	for attempt := 0; ; attempt++ {
		if attempt == 5 {
			t.Fatal("still failing after 5 attempts")
		}
		cfg := publisher.DefaultConfig()
		cfg.Brokers = b.brokers
		cfg.TopicTemplate = "{aggregate_type}"
		cfg.MaxMessageBytes = maxBytes
		cfg.Compression = "none" // the broker checks compressed sizes
		tcfg := publisher.DefaultTxnConfig()
		tcfg.TransactionalID = "eos-sink-poison-" + b.name
		tcfg.Interval = time.Hour
		out := newEOSOutcomes()
		s, err := publisher.NewTxn(cfg, tcfg, out, zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		err = func() error {
			for i, evs := range txns {
				end := lsn.LSN(100 * (i + 1))
				if end <= committed {
					continue
				}
				for _, ev := range evs {
					r, err := s.BuildWait(ctx, ev)
					var perr *publisher.Error
					if errors.As(err, &perr) && perr.Class == publisher.ClassPermanent {
						quarantined = append(quarantined, string(ev.EventID))
						continue
					}
					if err != nil {
						return err
					}
					if err := s.Send(ctx, r); err != nil {
						return err
					}
				}
				if err := s.EndTxn(ctx, lsn.TxnID(i+1), end, time.Now()); err != nil {
					return err
				}
				if !lowered {
					// The relay has checked the topic; now an operator
					// lowers its limit below the coming poison event.
					if err := s.Commit(ctx); err != nil {
						return err
					}
					setTopicConfig(t, b.brokers, topic, "max.message.bytes", "100000")
					lowered = true
				}
			}
			return s.Commit(ctx)
		}()
		if last := s.Stats().LastCommitted; last > committed {
			committed = last
		}
		s.Close(10 * time.Second)
		var limit *publisher.BatchLimitError
		switch {
		case err == nil && len(out.failed) == 0:
			if len(quarantined) != 1 || quarantined[0] != poison {
				t.Fatalf("quarantined %v, want just %s once", quarantined, poison)
			}
			var want []string
			for _, evs := range txns {
				for _, ev := range evs {
					if string(ev.EventID) != poison {
						want = append(want, string(ev.EventID))
					}
				}
			}
			checkCommitted(t, b.brokers, topic, want)
			t.Logf("%s: done after %d attempts", b.name, attempt+1)
			return
		case errors.As(err, &limit):
			maxBytes = limit.MaxMessageBytes
		case err != nil && !errors.Is(err, publisher.ErrTxnAborted):
			t.Fatalf("attempt %d: %v", attempt, err)
		}
		t.Logf("%s attempt %d: %v (%d failed)", b.name, attempt, err, len(out.failed))
	}
}
