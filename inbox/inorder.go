package inbox

import (
	"context"
	"errors"
	"time"
)

// Records is a run of records of one partition, in offset order, as a
// consumer adapter hands them to ApplyInOrder.
type Records struct {
	// Len is how many records there are.
	Len int
	// Parse reads record i into an Event (see Parse).
	Parse func(i int) (Event, error)
	// Applied is called with records [from, to) once they are applied or
	// skipped and committed: the adapter marks their offsets for commit.
	Applied func(from, to int)
	// Failed, if set, is called for each failed attempt at record i; the
	// record is retried.
	Failed func(i int, err error)
}

// ApplyInOrder applies recs through HandleBatch and retries from the first
// record that failed, with backoff from 1 ms doubling to retryMax (default
// 5 s), until every record is applied or ctx ends. A record of a partition
// is thus never applied before the records ahead of it, and never skipped:
// one that can never succeed stops its partition. It returns nil once all
// are applied, and ctx's error, joined with the last failure, when ctx
// ended first.
func (ib *Inbox) ApplyInOrder(ctx context.Context, db Beginner, recs Records, h Handler, retryMax time.Duration) error {
	wait := time.Millisecond
	if retryMax <= 0 {
		retryMax = 5 * time.Second
	}
	events := make([]Event, 0, recs.Len)
	for done := 0; done < recs.Len; {
		events = events[:0]
		var parseErr error
		for i := done; i < recs.Len; i++ {
			ev, err := recs.Parse(i)
			if err != nil {
				parseErr = err
				break
			}
			events = append(events, ev)
		}
		results, err := ib.HandleBatch(ctx, db, events, h)
		if len(results) > 0 {
			recs.Applied(done, done+len(results))
			done += len(results)
			wait = time.Millisecond
		}
		if err == nil {
			err = parseErr
		}
		if err == nil {
			continue
		}
		if ctx.Err() != nil {
			return errors.Join(ctx.Err(), err)
		}
		if recs.Failed != nil {
			recs.Failed(done, err)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return errors.Join(ctx.Err(), err)
		case <-t.C:
		}
		wait = min(2*wait, retryMax)
	}
	return nil
}
