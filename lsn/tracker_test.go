package lsn

import (
	"math/rand/v2"
	"testing"
	"time"
)

func TestParseAndString(t *testing.T) {
	for _, s := range []string{"0/0", "16/B374D848", "FFFFFFFF/FFFFFFFF", "0/1"} {
		l, err := Parse(s)
		if err != nil {
			t.Fatalf("Parse(%q): %v", s, err)
		}
		if l.String() != s {
			t.Errorf("Parse(%q).String() = %q", s, l.String())
		}
	}
	if l, _ := Parse("16/B374D848"); l != 0x16B374D848 {
		t.Errorf("Parse(16/B374D848) = %#x", uint64(l))
	}
	if _, err := Parse("nonsense"); err == nil {
		t.Error("Parse(nonsense) succeeded")
	}
}

// A later transaction acknowledged first must not move the confirmed
// position past an earlier one that is still waiting.
func TestOutOfOrderAcksConfirmOnlyACompletePrefix(t *testing.T) {
	tr := NewTracker(100, Limits{Events: 100, Bytes: 1 << 20})
	a := tr.Open(time.Time{})
	tr.Add(a, 10)
	tr.Add(a, 10)
	tr.Close(a, 200)
	b := tr.Open(time.Time{})
	tr.Add(b, 10)
	tr.Close(b, 300)

	tr.Ack(b, 10)
	if got := tr.Confirmed(); got != 100 {
		t.Fatalf("confirmed %v after acking only the later txn, want 0/64", got)
	}
	tr.Ack(a, 10)
	if got := tr.Confirmed(); got != 100 {
		t.Fatalf("confirmed %v with one event of the first txn unacked", got)
	}
	tr.Ack(a, 10)
	if got := tr.Confirmed(); got != 300 {
		t.Fatalf("confirmed %v after all acks, want %v", got, LSN(300))
	}
	if s := tr.Stats(); s.InFlightEvents != 0 || s.InFlightBytes != 0 || s.InFlightTxns != 0 {
		t.Fatalf("stats after all acks: %+v", s)
	}
}

// A transaction whose events are all acked is still not confirmed before
// its commit has been read: more rows of it may follow.
func TestOpenTransactionIsNeverConfirmed(t *testing.T) {
	tr := NewTracker(100, Limits{Events: 100, Bytes: 1 << 20})
	a := tr.Open(time.Time{})
	tr.Add(a, 1)
	tr.Ack(a, 1)
	if got := tr.Confirmed(); got != 100 {
		t.Fatalf("confirmed %v for an open transaction", got)
	}
	if tr.ConfirmIdle(500) {
		t.Fatal("ConfirmIdle moved the position while a transaction was open")
	}
	tr.Close(a, 200)
	if got := tr.Confirmed(); got != 200 {
		t.Fatalf("confirmed %v after close, want 200", got)
	}
}

func TestEmptyTransactionConfirmsAtClose(t *testing.T) {
	tr := NewTracker(100, Limits{Events: 1, Bytes: 1})
	a := tr.Open(time.Time{})
	tr.Close(a, 150)
	if got := tr.Confirmed(); got != 150 {
		t.Fatalf("confirmed %v, want 150", got)
	}
}

// The keepalive's WAL end may be confirmed only when nothing is in flight:
// confirming it with acks pending would release events Kafka never took.
func TestConfirmIdleOnlyWhenNothingPending(t *testing.T) {
	tr := NewTracker(100, Limits{Events: 10, Bytes: 1000})
	a := tr.Open(time.Time{})
	tr.Add(a, 5)
	tr.Close(a, 200)
	if tr.ConfirmIdle(900) {
		t.Fatal("ConfirmIdle moved the position with an ack pending")
	}
	if got := tr.Confirmed(); got != 100 {
		t.Fatalf("confirmed %v with an ack pending", got)
	}
	tr.Ack(a, 5)
	if !tr.ConfirmIdle(900) || tr.Confirmed() != 900 {
		t.Fatalf("ConfirmIdle did not move an idle tracker: %v", tr.Confirmed())
	}
	if tr.ConfirmIdle(800) || tr.Confirmed() != 900 {
		t.Fatalf("ConfirmIdle moved backwards: %v", tr.Confirmed())
	}
}

func TestFullByEventsAndBytes(t *testing.T) {
	tr := NewTracker(1, Limits{Events: 2, Bytes: 100})
	a := tr.Open(time.Time{})
	tr.Add(a, 10)
	if tr.Full() {
		t.Fatal("full after one event")
	}
	tr.Add(a, 10)
	if !tr.Full() {
		t.Fatal("not full at the event bound")
	}
	tr.Ack(a, 10)
	if tr.Full() {
		t.Fatal("still full after an ack")
	}
	tr.Add(a, 95)
	if !tr.Full() {
		t.Fatal("not full at the byte bound")
	}
}

// Many transactions, acks in random order: the confirmed position must at
// every step equal the end of the longest fully acknowledged prefix, and the
// ring must survive growing.
func TestRandomAckOrderMatchesModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 50; round++ {
		tr := NewTracker(10, Limits{Events: 1 << 30, Bytes: 1 << 40})
		type ev struct {
			txn TxnID
			idx int
		}
		n := 1 + rng.IntN(300)
		ends := make([]LSN, n)
		pending := make([]int, n)
		var events []ev
		for i := 0; i < n; i++ {
			id := tr.Open(time.Time{})
			if int(id-1) != i {
				t.Fatalf("id %d for txn %d", id, i)
			}
			k := rng.IntN(4)
			for j := 0; j < k; j++ {
				tr.Add(id, 1)
				events = append(events, ev{id, i})
			}
			pending[i] = k
			ends[i] = LSN(100 + 10*i)
			tr.Close(id, ends[i])
		}
		rng.Shuffle(len(events), func(i, j int) { events[i], events[j] = events[j], events[i] })
		check := func() {
			want := LSN(10)
			for i := 0; i < n && pending[i] == 0; i++ {
				want = ends[i]
			}
			if got := tr.Confirmed(); got != want {
				t.Fatalf("round %d: confirmed %v, model says %v", round, got, want)
			}
		}
		check()
		for _, e := range events {
			tr.Ack(e.txn, 1)
			pending[e.idx]--
			check()
		}
		if got := tr.Confirmed(); got != ends[n-1] {
			t.Fatalf("round %d: end %v, want %v", round, got, ends[n-1])
		}
	}
}

func TestUnknownTxnPanics(t *testing.T) {
	tr := NewTracker(1, Limits{Events: 1, Bytes: 1})
	defer func() {
		if recover() == nil {
			t.Fatal("Ack of an unknown transaction did not panic")
		}
	}()
	tr.Ack(42, 1)
}

func TestStatsOldestInFlight(t *testing.T) {
	tr := NewTracker(1, Limits{Events: 10, Bytes: 100})
	now := time.Unix(1000, 0)
	tr.now = func() time.Time { return now }
	a := tr.Open(time.Unix(900, 0))
	tr.Add(a, 1)
	tr.Close(a, 5)
	if s := tr.Stats(); !s.OldestInFlight.Equal(now) || s.InFlightEvents != 1 {
		t.Fatalf("stats %+v", s)
	}
	tr.Ack(a, 1)
	if s := tr.Stats(); !s.OldestInFlight.IsZero() || !s.ConfirmedCommitTime.Equal(time.Unix(900, 0)) {
		t.Fatalf("stats after ack %+v", s)
	}
}

// Acknowledged events still count against the bound until PostgreSQL has
// been told: a crash before that report re-delivers them. This is what
// bounds a crash's duplicates by Limits.Events.
func TestUnreportedEventsCountUntilReported(t *testing.T) {
	tr := NewTracker(1, Limits{Events: 3, Bytes: 1 << 20})
	for i, end := range []LSN{10, 20, 30} {
		id := tr.Open(time.Time{})
		tr.Add(id, 1)
		tr.Close(id, end)
		tr.Ack(id, 1)
		if i < 2 && tr.Full() {
			t.Fatalf("full after %d acknowledged events", i+1)
		}
	}
	if !tr.Full() {
		t.Fatal("three acknowledged, unreported events do not fill a bound of three")
	}
	if s := tr.Stats(); s.InFlightEvents != 0 || s.UnreportedEvents != 3 || s.Confirmed != 30 {
		t.Fatalf("stats %+v", s)
	}
	tr.Reported(20)
	if tr.Full() || tr.Stats().UnreportedEvents != 1 {
		t.Fatalf("after reporting 20: full=%v unreported=%d", tr.Full(), tr.Stats().UnreportedEvents)
	}
	tr.Reported(30)
	if tr.Stats().UnreportedEvents != 0 {
		t.Fatalf("unreported %d after reporting everything", tr.Stats().UnreportedEvents)
	}
}

// A transaction larger than the bound must still flow: its acknowledged
// events cannot be confirmed before its commit arrives, so they do not
// count, or the reader would wait for ever.
func TestOpenTransactionLargerThanBoundFlows(t *testing.T) {
	tr := NewTracker(1, Limits{Events: 2, Bytes: 1 << 20})
	id := tr.Open(time.Time{})
	for i := 0; i < 10; i++ {
		if tr.Full() {
			t.Fatalf("full at event %d of an open transaction whose earlier events are acknowledged", i)
		}
		tr.Add(id, 1)
		tr.Ack(id, 1)
	}
	tr.Close(id, 50)
	if tr.Confirmed() != 50 || tr.Stats().UnreportedEvents != 10 || !tr.Full() {
		t.Fatalf("after close: %+v", tr.Stats())
	}
	tr.Reported(50)
	if tr.Full() {
		t.Fatal("full after reporting")
	}
}
