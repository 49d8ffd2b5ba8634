package lsn

import (
	"sync"
	"time"
)

// TxnID names one transaction registered with a Tracker. IDs increase in the
// order transactions were opened, which is their commit order in the WAL.
type TxnID uint64

// Limits bound what may be in flight. Events counts every event that a crash
// would re-deliver: sent and not yet acknowledged, or acknowledged but not
// yet reported to PostgreSQL. Bytes counts unacknowledged bytes, which is
// what holds memory.
type Limits struct {
	Events int
	Bytes  int64
}

// Stats is a snapshot of a Tracker for metrics and the admin endpoint.
type Stats struct {
	Confirmed           LSN
	ConfirmedCommitTime time.Time // zero until a transaction has been confirmed
	InFlightEvents      int
	InFlightBytes       int64
	UnreportedEvents    int // acknowledged and confirmed, not yet reported
	InFlightTxns        int
	OldestInFlight      time.Time // when the oldest unacknowledged event was sent; zero if none
}

// txn is the tracker's record of one transaction.
type txn struct {
	end        LSN
	commitTime time.Time
	firstSent  time.Time
	pending    int
	added      int
	closed     bool
}

// unreported is a confirmed transaction whose end PostgreSQL has not yet
// been told about.
type unreported struct {
	end    LSN
	events int
}

// Tracker records transactions in commit order and answers what is safe to
// confirm. It is safe for concurrent use: one goroutine, the relay's read
// loop, opens, adds to, closes and acks transactions and reports what it
// confirmed, while others (the admin endpoint, the stall watch, the slot
// poller) read Stats.
type Tracker struct {
	limits Limits
	now    func() time.Time

	mu                  sync.Mutex
	ring                []txn // ring buffer of open or unacknowledged transactions
	head                int   // ring index of the oldest transaction
	count               int   // transactions in the ring
	headID              TxnID // ID of the transaction at head
	confirmed           LSN
	confirmedCommitTime time.Time
	events              int
	bytes               int64

	unreported       []unreported // confirmed, in order, oldest at unreportedHead
	unreportedHead   int
	unreportedEvents int
}

// NewTracker returns a tracker that starts at the slot's confirmed position.
func NewTracker(start LSN, limits Limits) *Tracker {
	if limits.Events <= 0 {
		limits.Events = 1
	}
	if limits.Bytes <= 0 {
		limits.Bytes = 1
	}
	return &Tracker{
		limits:    limits,
		now:       time.Now,
		ring:      make([]txn, 64),
		headID:    1,
		confirmed: start,
	}
}

// UseClock makes the tracker read time from now, e.g. a test's fake clock.
// Call it before the tracker is used.
func (t *Tracker) UseClock(now func() time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.now = now
}

// Open registers a transaction that has begun arriving. It must be called in
// WAL order; the transaction cannot be confirmed before Close.
func (t *Tracker) Open(commitTime time.Time) TxnID {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.count == len(t.ring) {
		t.grow()
	}
	id := t.headID + TxnID(t.count)
	t.ring[(t.head+t.count)&(len(t.ring)-1)] = txn{commitTime: commitTime}
	t.count++
	return id
}

func (t *Tracker) grow() {
	bigger := make([]txn, 2*len(t.ring))
	for i := 0; i < t.count; i++ {
		bigger[i] = t.ring[(t.head+i)&(len(t.ring)-1)]
	}
	t.ring, t.head = bigger, 0
}

// at returns the record of a registered transaction; the caller holds mu.
func (t *Tracker) at(id TxnID) *txn {
	offset := int(id - t.headID)
	if id < t.headID || offset >= t.count {
		panic("lsn: unknown transaction id")
	}
	return &t.ring[(t.head+offset)&(len(t.ring)-1)]
}

// Add records that one event of size bytes of the transaction is about to be
// sent to Kafka. Call it before sending, so an ack can never precede it.
func (t *Tracker) Add(id TxnID, bytes int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	x := t.at(id)
	if x.pending == 0 && x.firstSent.IsZero() {
		x.firstSent = t.now()
	}
	x.pending++
	x.added++
	t.events++
	t.bytes += int64(bytes)
}

// Grow adds bytes to what is in flight: an event added before its size
// was known is now sent with it. Ack it with the sum.
func (t *Tracker) Grow(bytes int) {
	t.mu.Lock()
	t.bytes += int64(bytes)
	t.mu.Unlock()
}

// Close records the end of a transaction: every event has been added, and end
// is the position just past its commit record.
func (t *Tracker) Close(id TxnID, end LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	x := t.at(id)
	x.closed, x.end = true, end
	t.advance()
}

// Ack records Kafka's acknowledgement of one event of size bytes.
func (t *Tracker) Ack(id TxnID, bytes int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	x := t.at(id)
	x.pending--
	t.events--
	t.bytes -= int64(bytes)
	t.advance()
}

// advance pops fully acknowledged transactions from the head and confirms
// their end; the caller holds mu.
func (t *Tracker) advance() {
	for t.count > 0 {
		x := &t.ring[t.head]
		if !x.closed || x.pending > 0 {
			return
		}
		if x.end > t.confirmed {
			t.confirmed = x.end
		}
		t.confirmedCommitTime = x.commitTime
		if x.added > 0 {
			t.unreported = append(t.unreported, unreported{end: x.end, events: x.added})
			t.unreportedEvents += x.added
		}
		*x = txn{}
		t.head = (t.head + 1) & (len(t.ring) - 1)
		t.count--
		t.headID++
	}
}

// Confirmed returns the position up to which everything read has been
// acknowledged by Kafka: the only safe flush position to report.
func (t *Tracker) Confirmed() LSN {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.confirmed
}

// ConfirmIdle moves the confirmed position to walEnd, the server's WAL end from
// a keepalive, but only when no transaction is open or unacknowledged. This is
// what keeps the slot from holding WAL while the outbox is idle and other
// tables are busy. It reports whether the position moved.
func (t *Tracker) ConfirmIdle(walEnd LSN) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.count > 0 || walEnd <= t.confirmed {
		return false
	}
	t.confirmed = walEnd
	return true
}

// Reported records that PostgreSQL was sent flush position l: the events of
// transactions ending at or before it will not be re-delivered after a
// crash, so they no longer count against the bound.
func (t *Tracker) Reported(l LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for t.unreportedHead < len(t.unreported) && t.unreported[t.unreportedHead].end <= l {
		t.unreportedEvents -= t.unreported[t.unreportedHead].events
		t.unreportedHead++
	}
	if t.unreportedHead == len(t.unreported) {
		t.unreported, t.unreportedHead = t.unreported[:0], 0
	} else if t.unreportedHead > len(t.unreported)/2 {
		n := copy(t.unreported, t.unreported[t.unreportedHead:])
		t.unreported, t.unreportedHead = t.unreported[:n], 0
	}
}

// Idle reports whether no transaction is open or waiting for acks.
func (t *Tracker) Idle() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.count == 0
}

// Full reports whether the bound is reached: the reader must stop reading
// WAL until acks free room or, when the confirmed position
// has moved, until it reports that position to PostgreSQL. Counting the
// acknowledged but unreported events is what bounds the duplicates of a
// crash by Limits.Events. Events of a transaction still open do not count
// once acknowledged: it cannot be confirmed before its commit is read, and
// counting them would stall a transaction larger than the bound.
func (t *Tracker) Full() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.events+t.unreportedEvents >= t.limits.Events || t.bytes >= t.limits.Bytes
}

// Stats returns a snapshot for metrics and the admin endpoint.
func (t *Tracker) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := Stats{
		Confirmed:           t.confirmed,
		ConfirmedCommitTime: t.confirmedCommitTime,
		InFlightEvents:      t.events,
		InFlightBytes:       t.bytes,
		UnreportedEvents:    t.unreportedEvents,
		InFlightTxns:        t.count,
	}
	for i := 0; i < t.count; i++ {
		x := &t.ring[(t.head+i)&(len(t.ring)-1)]
		if x.pending > 0 {
			s.OldestInFlight = x.firstSent
			break
		}
	}
	return s
}
