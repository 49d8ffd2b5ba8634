package progress

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/lsn"
)

// memStore keeps what is written in memory, in order.
type memStore struct {
	mu     sync.Mutex
	writes []Record
	fail   error // every Write fails with it when set
	// missing: the topic was deleted; Write fails with ErrTopicMissing
	// until Recreate, which counts in remade.
	missing bool
	remade  int
}

func (s *memStore) Topic() string { return "outbox-relay.progress" }

func (s *memStore) Latest(context.Context, []byte) (Record, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.writes) == 0 {
		return Record{}, false, nil
	}
	return s.writes[len(s.writes)-1], true, nil
}

func (s *memStore) Write(_ []byte, r Record) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return s.fail
	}
	if s.missing {
		return ErrTopicMissing
	}
	s.writes = append(s.writes, r)
	return nil
}

func (s *memStore) Recreate(context.Context) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	was := s.missing
	if was {
		s.missing = false
		s.remade++
	}
	return was, nil
}
func (s *memStore) Close() error { return nil }

func (s *memStore) positions() []lsn.LSN {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []lsn.LSN
	for _, r := range s.writes {
		out = append(out, r.LSN)
	}
	return out
}

// TestFlushWritesWhatIsPending: a record offered while the writer waits
// out its interval is written by Flush at once, and once Flush returns, a
// record the caller writes itself is the last one stored: the writer holds
// nothing older that could land after it. A recovery of a lost slot relies
// on that for its mark.
func TestFlushWritesWhatIsPending(t *testing.T) {
	s := &memStore{}
	w := NewWriter(s, time.Hour, zerolog.Nop(), nil)
	key := Key("outbox_relay", "7312345678901234567")
	w.Offer(key, Record{LSN: 1, Timeline: 1})
	w.Offer(key, Record{LSN: 2, Timeline: 1})
	if err := w.Flush(context.Background()); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	// The first offer may have been replaced by the second before the
	// writer took it; either way the second is stored once Flush returns.
	if got := s.positions(); !slices.Equal(got, []lsn.LSN{1, 2}) && !slices.Equal(got, []lsn.LSN{2}) {
		t.Fatalf("after Flush the store holds %v, want [1 2] or [2]", got)
	}
	mark := Record{LSN: 2, Timeline: 1, RecoverySince: time.Unix(1000, 0)}
	if err := s.Write(key, mark); err != nil {
		t.Fatal(err)
	}
	w.Close(time.Second)
	rec, _, _ := s.Latest(context.Background(), key)
	if rec != mark {
		t.Fatalf("the last record stored is %+v, want the caller's %+v: the writer wrote after Flush returned", rec, mark)
	}
	if err := w.Flush(context.Background()); err != nil {
		t.Fatalf("Flush of a closed writer: %v, want nil (nothing is pending)", err)
	}
}

// TestFlushReportsAFailedWrite: a Flush whose write fails says so, so the
// caller does not go on as if the store had the record.
func TestFlushReportsAFailedWrite(t *testing.T) {
	down := errors.New("brokers down")
	s := &memStore{fail: down}
	w := NewWriter(s, time.Hour, zerolog.Nop(), nil)
	defer w.Close(time.Second)
	w.Offer(Key("outbox_relay", "1"), Record{LSN: 7, Timeline: 1})
	if err := w.Flush(context.Background()); !errors.Is(err, down) {
		t.Fatalf("Flush with the store failing: %v, want %v", err, down)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := w.Flush(ctx); err == nil {
		// The loop may answer before it sees ctx ended; then the write
		// failed again and must still be reported.
		t.Fatalf("Flush with an ended context and a failing store returned nil")
	}
}

// TestWriteMakesAMissingTopicAgain: a write that finds the progress topic
// gone (deleted under the running relay) makes it again at once and
// stores the record, rather than failing until the stream restarts.
func TestWriteMakesAMissingTopicAgain(t *testing.T) {
	s := &memStore{missing: true}
	w := NewWriter(s, time.Hour, zerolog.Nop(), nil)
	defer w.Close(time.Second)
	w.Offer(Key("outbox_relay", "1"), Record{LSN: 9, Timeline: 1})
	if err := w.Flush(context.Background()); err != nil {
		t.Fatalf("Flush with the topic missing: %v, want it made again and the record written", err)
	}
	if got := s.positions(); !slices.Equal(got, []lsn.LSN{9}) || s.remade != 1 {
		t.Fatalf("store holds %v after %d re-creations, want [9] after 1", got, s.remade)
	}
}
