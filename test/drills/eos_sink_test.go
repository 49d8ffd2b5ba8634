package drills

// The exactly-once sink (publisher.TxnSink) against every broker kind:
// a stream of source transactions with their progress records, read back
// with read_committed exactly once and whole, and a fenced sink that must
// report ErrFenced and never commit again.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/sink"
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

// eosSink drives the exactly-once sink as the read loop does: items in
// WAL order on its Input, every outcome kept by a goroutine that reads
// them, so the drill can wait for them.
type eosSink struct {
	s *publisher.TxnSink

	mu        sync.Mutex
	sent      int
	acked     int
	failed    []*sink.Error
	committed int
	aborted   int
	last      lsn.LSN // the last progress committed
	changed   chan struct{}
	collected chan struct{}
}

func newEOSSink(t *testing.T, brokers []string, id, progressTopic string) *eosSink {
	t.Helper()
	cfg := publisher.DefaultConfig()
	cfg.Brokers = brokers
	cfg.TopicTemplate = "{aggregate_type}"
	tcfg := publisher.DefaultTxnConfig()
	tcfg.TransactionalID = id
	tcfg.Interval = 20 * time.Millisecond
	tcfg.BatchEvents = 50 // many Kafka transactions per test
	return startEOSSink(t, cfg, tcfg)
}

func startEOSSink(t *testing.T, cfg publisher.Config, tcfg publisher.TxnConfig) *eosSink {
	t.Helper()
	s, err := publisher.NewTxnSink(cfg, tcfg, zerolog.Nop())
	if err != nil {
		t.Fatalf("new exactly-once sink: %v", err)
	}
	e := &eosSink{s: s, changed: make(chan struct{}, 1), collected: make(chan struct{})}
	go func() {
		defer close(e.collected)
		for o := range s.Outcomes() {
			e.mu.Lock()
			switch {
			case o.KafkaTxn != nil && o.KafkaTxn.Committed:
				e.committed++
				if o.KafkaTxn.End != 0 {
					e.last = o.KafkaTxn.End
				}
			case o.KafkaTxn != nil && !o.KafkaTxn.Split:
				e.aborted++
			case o.KafkaTxn != nil:
			case o.Err != nil:
				e.failed = append(e.failed, o.Err)
			default:
				e.acked++
			}
			e.mu.Unlock()
			select {
			case e.changed <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() { e.close(10 * time.Second) })
	return e
}

func (e *eosSink) put(ctx context.Context, it sink.Item) error {
	select {
	case e.s.Input() <- it:
		if it.Record != nil {
			e.mu.Lock()
			e.sent++
			e.mu.Unlock()
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// end ends source transaction txn at end, with a progress record naming
// end in progressTopic when that is given.
func (e *eosSink) end(ctx context.Context, txn int, end lsn.LSN, progressTopic, key string) error {
	se := &sink.SourceEnd{Txn: lsn.TxnID(txn), End: end, CommitTime: time.Now()}
	if progressTopic != "" {
		se.Progress = &sink.ProgressRecord{Topic: progressTopic, Key: []byte(key), Value: []byte(end.String())}
	}
	return e.put(ctx, sink.Item{End: se})
}

// commit flushes the sink and waits until every record sent has its
// outcome; it returns the first failure.
func (e *eosSink) commit(ctx context.Context) error {
	if err := e.put(ctx, sink.Item{Flush: true}); err != nil {
		return err
	}
	for {
		e.mu.Lock()
		done, failed := e.acked+len(e.failed) >= e.sent, e.failed
		e.mu.Unlock()
		if done {
			if len(failed) > 0 {
				return failed[0]
			}
			return nil
		}
		select {
		case <-e.changed:
		case <-e.collected:
			return errors.New("the sink closed its outcomes with records unanswered")
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// eosState is what an eosSink's outcomes added up to.
type eosState struct {
	acked              int
	failed             []*sink.Error
	committed, aborted int
	last               lsn.LSN
}

func (e *eosSink) state() eosState {
	e.mu.Lock()
	defer e.mu.Unlock()
	return eosState{e.acked, append([]*sink.Error(nil), e.failed...), e.committed, e.aborted, e.last}
}

func (e *eosSink) close(timeout time.Duration) error {
	err := e.s.Close(timeout)
	select {
	case <-e.collected:
	case <-time.After(timeout):
	}
	return err
}

// eosStream sends source transactions first..first+n-1 of topic, each of
// 1 to 4 events, with progress records in progressTopic, and returns their
// event ids.
func eosStream(ctx context.Context, e *eosSink, topic, progressTopic, key string, first, n int) ([]string, error) {
	var sent []string
	for i := first; i < first+n; i++ {
		for j := range i%4 + 1 {
			id := fmt.Sprintf("%s-%d-%d", topic, i, j)
			ev := &event.Event{
				EventID: []byte(id), AggregateType: []byte(topic), AggregateID: []byte("agg-" + strconv.Itoa((i+j)%13)),
				EventType: []byte("Happened"), SchemaVersion: []byte("1"), Payload: []byte(`{}`),
				OccurredAt: []byte("2026-12-01 03:00:00+00"), Txn: uint64(i),
			}
			r, err := sink.BuildWhenReady(ctx, e.s.Build, ev)
			if err != nil {
				return sent, err
			}
			if err := e.put(ctx, sink.Item{Record: r}); err != nil {
				return sent, err
			}
			sent = append(sent, id)
		}
		if err := e.end(ctx, i, lsn.LSN(i*100), progressTopic, key); err != nil {
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
				id := "eos-sink-" + b.name
				s := newEOSSink(t, b.brokers, id, progress)
				sent, err := eosStream(ctx, s, topic, progress, id, 1, 200)
				if err != nil {
					t.Fatalf("stream: %v", err)
				}
				if err := s.close(30 * time.Second); err != nil {
					t.Fatalf("close: %v", err)
				}
				st := s.state()
				if st.acked != len(sent) || len(st.failed) != 0 {
					t.Fatalf("%d acked, %d failed of %d sent", st.acked, len(st.failed), len(sent))
				}
				checkCommitted(t, b.brokers, topic, sent)
				if st.last != lsn.LSN(200*100) || st.aborted != 0 || st.committed < 10 {
					t.Fatalf("state %+v", st)
				}
				last := lsn.LSN(200 * 100).String()
				harness.ConsumeUntil(t, b.brokers, "^"+progress+"$", 30*time.Second, func(all []harness.Record) bool {
					return len(all) > 0 && string(all[len(all)-1].Value) == last
				})
				t.Logf("%s: %d events in %d Kafka transactions", b.name, len(sent), st.committed)
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
				old := newEOSSink(t, b.brokers, id, progress)
				before, err := eosStream(ctx, old, topic, progress, id, 1, 5)
				if err == nil {
					err = old.commit(ctx)
				}
				if err != nil {
					t.Fatalf("before the fence: %v", err)
				}
				newer := newEOSSink(t, b.brokers, id, progress)
				_, err = eosStream(ctx, old, topic, progress, id, 6, 3)
				if err == nil {
					err = old.commit(ctx)
				}
				if !errors.Is(err, sink.ErrFenced) {
					t.Fatalf("old sink after the fence: %v, want ErrFenced", err)
				}
				for _, f := range old.state().failed {
					if f.Class != sink.ClassFenced {
						t.Fatalf("failure class %s, want %s", f.Class, sink.ClassFenced)
					}
				}
				after, err := eosStream(ctx, newer, topic, progress, id, 9, 3)
				if err == nil {
					err = newer.commit(ctx)
				}
				if err != nil {
					t.Fatalf("newer sink: %v", err)
				}
				if st := old.state(); st.committed != 1 {
					t.Fatalf("fenced sink committed %d times, want the 1 before the fence", st.committed)
				}
				checkCommitted(t, b.brokers, topic, append(before, after...))
			})
		})
	}
}

// eosEvent is one outbox event of eosStream's shape with a payload of
// size bytes.
func eosEvent(topic, id string, txn int, size int) *event.Event {
	payload := make([]byte, size)
	for i := range payload {
		payload[i] = 'p'
	}
	payload[0], payload[size-1] = '"', '"'
	return &event.Event{
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
	var txns [][]*event.Event
	for i := range 4 {
		var evs []*event.Event
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
		s := startEOSSink(t, cfg, tcfg)
		err := func() error {
			for i, evs := range txns {
				end := lsn.LSN(100 * (i + 1))
				if end <= committed {
					continue
				}
				for _, ev := range evs {
					r, err := sink.BuildWhenReady(ctx, s.s.Build, ev)
					var perr *sink.Error
					if errors.As(err, &perr) && perr.Class == sink.ClassPermanent {
						quarantined = append(quarantined, string(ev.EventID))
						continue
					}
					if err != nil {
						return err
					}
					if err := s.put(ctx, sink.Item{Record: r}); err != nil {
						return err
					}
				}
				if err := s.end(ctx, i+1, end, "", ""); err != nil {
					return err
				}
				if !lowered {
					// The relay has checked the topic; now an operator
					// lowers its limit below the coming poison event.
					if err := s.commit(ctx); err != nil {
						return err
					}
					setTopicConfig(t, b.brokers, topic, "max.message.bytes", "100000")
					lowered = true
				}
			}
			return s.commit(ctx)
		}()
		s.close(10 * time.Second)
		st := s.state()
		if st.last > committed {
			committed = st.last
		}
		var limit *sink.BatchLimitError
		switch {
		case err == nil && len(st.failed) == 0:
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
		t.Logf("%s attempt %d: %v (%d failed)", b.name, attempt, err, len(st.failed))
	}
}
