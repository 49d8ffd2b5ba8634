package publisher

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/sink"
)

// driver feeds a sink the way the read loop does, on the test's goroutine,
// and keeps every outcome, read on a goroutine of its own, so a test can
// wait for them.
type driver struct {
	t testing.TB
	s sink.Sink

	mu        sync.Mutex
	sent      int
	acked     []sink.Delivery
	failed    []*sink.Error
	reports   []sink.TxnReport
	changed   chan struct{}
	collected chan struct{} // closed once Outcomes is
}

func drive(t testing.TB, s sink.Sink) *driver {
	d := &driver{t: t, s: s, changed: make(chan struct{}, 1), collected: make(chan struct{})}
	go d.collect()
	t.Cleanup(func() { d.close(10 * time.Second) })
	return d
}

func (d *driver) collect() {
	defer close(d.collected)
	for o := range d.s.Outcomes() {
		d.mu.Lock()
		switch {
		case o.KafkaTxn != nil:
			d.reports = append(d.reports, *o.KafkaTxn)
		case o.Err != nil:
			d.failed = append(d.failed, o.Err)
		default:
			d.acked = append(d.acked, o.Delivery)
		}
		d.mu.Unlock()
		select {
		case d.changed <- struct{}{}:
		default:
		}
	}
}

// put hands the sink an item, waiting while it is full.
func (d *driver) put(ctx context.Context, it sink.Item) error {
	select {
	case d.s.Input() <- it:
		if it.Record != nil {
			d.mu.Lock()
			d.sent++
			d.mu.Unlock()
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("the sink took no item: %w", ctx.Err())
	}
}

func (d *driver) send(ctx context.Context, r *Record) error { return d.put(ctx, sink.Item{Record: r}) }

func (d *driver) build(ctx context.Context, ev *event.Event) (*Record, error) {
	r, err := sink.BuildWhenReady(ctx, d.s.Build, ev)
	if err != nil {
		return nil, err
	}
	return r.(*Record), nil
}

// stream hands txns to the sink as the read loop does, each end with the
// progress record progress makes (nil: none); events Build refuses
// permanently are returned as quarantined, as the loop would quarantine
// them.
func (d *driver) stream(ctx context.Context, txns []sourceTxn, progress func(lsn.LSN) *sink.ProgressRecord) (quarantined []string, err error) {
	for _, st := range txns {
		for _, ev := range st.events {
			r, err := d.build(ctx, ev)
			if err != nil {
				var perr *sink.Error
				if errors.As(err, &perr) && perr.Class == sink.ClassPermanent {
					quarantined = append(quarantined, string(ev.EventID))
					continue
				}
				return quarantined, err
			}
			if err := d.send(ctx, r); err != nil {
				return quarantined, err
			}
		}
		end := &sink.SourceEnd{Txn: st.id, End: st.end, CommitTime: time.Now()}
		if progress != nil {
			end.Progress = progress(st.end)
		}
		if err := d.put(ctx, sink.Item{End: end}); err != nil {
			return quarantined, err
		}
	}
	return quarantined, nil
}

// settle flushes the sink and waits until every record sent has its
// outcome; it returns the first failure, if any.
func (d *driver) settle(ctx context.Context) error {
	if err := d.put(ctx, sink.Item{Flush: true}); err != nil {
		return err
	}
	if err := d.await(ctx, func() bool { return len(d.acked)+len(d.failed) >= d.sent }); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.failed) > 0 {
		return d.failed[0]
	}
	return nil
}

// await waits until cond, called under the lock, holds.
func (d *driver) await(ctx context.Context, cond func() bool) error {
	for {
		d.mu.Lock()
		ok := cond()
		d.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-d.changed:
		case <-d.collected:
			d.mu.Lock()
			ok := cond()
			d.mu.Unlock()
			if !ok {
				return errors.New("the sink closed its outcomes")
			}
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// waitFor fails the test unless cond, called under the lock, holds within
// timeout.
func (d *driver) waitFor(timeout time.Duration, what string, cond func() bool) {
	d.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := d.await(ctx, cond); err != nil {
		d.t.Fatalf("waiting for %s: %v", what, err)
	}
}

func (d *driver) counts() (acked, failed int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.acked), len(d.failed)
}

func (d *driver) failures() []*sink.Error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]*sink.Error(nil), d.failed...)
}

// txnStats sums the sink's reports of Kafka transactions.
type txnStats struct {
	committed, aborted, split int
	lastCommitted             lsn.LSN // the last progress committed
}

func (s txnStats) String() string {
	return "committed " + strconv.Itoa(s.committed) + ", aborted " + strconv.Itoa(s.aborted) +
		", split " + strconv.Itoa(s.split) + ", last committed " + s.lastCommitted.String()
}

func (d *driver) stats() txnStats {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.statsLocked()
}

// statsLocked is stats for a caller that holds d.mu.
func (d *driver) statsLocked() txnStats {
	var st txnStats
	for _, r := range d.reports {
		switch {
		case r.Split:
			st.split++
		case !r.Committed:
			st.aborted++
		default:
			st.committed++
			if r.End != 0 {
				st.lastCommitted = r.End
			}
		}
	}
	return st
}

// close closes the sink and waits for the last outcome it reports.
func (d *driver) close(timeout time.Duration) error {
	err := d.s.Close(timeout)
	select {
	case <-d.collected:
	case <-time.After(timeout):
	}
	return err
}
