package inbox

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
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
	// Raw, if set, returns record i as it arrived. Then a record Parse
	// refuses is set aside (see Unparsable) and counted, and the records
	// after it go on; without Raw it is retried like a failure, for ever,
	// since parsing it again gives the same answer.
	Raw func(i int) RawRecord
}

// RawRecord is one Kafka record as it arrived, with where it came from.
type RawRecord struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []Header
}

// ApplyInOrder applies recs through HandleBatch and retries from the first
// record that failed, with backoff from 1 ms doubling to retryMax (default
// 5 s), until every record is applied or ctx ends. A record of a partition
// is thus never applied before the records ahead of it, and never skipped:
// one that can never succeed stops its partition. A record no event can
// be read from is the exception when recs.Raw is set: it is kept in the
// unparsable table (and counted, and reported to Config.OnUnparsable),
// and the records after it go on. It returns nil once all
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
		var err error
		if len(events) == 0 && parseErr != nil && recs.Raw != nil {
			// The record at done can never be read: set it aside, in a
			// transaction of its own, before its offset is marked.
			if err = ib.setAside(ctx, db, recs.Raw(done), parseErr); err == nil {
				recs.Applied(done, done+1)
				done++
				wait = time.Millisecond
				continue
			}
		} else {
			var results []Result
			results, err = ib.HandleBatch(ctx, db, events, h)
			if len(results) > 0 {
				recs.Applied(done, done+len(results))
				done += len(results)
				wait = time.Millisecond
			}
			// A record that cannot be parsed is a failure only where it
			// cannot be set aside; otherwise the next round does.
			if err == nil && recs.Raw == nil {
				err = parseErr
			}
			if err == nil {
				continue
			}
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

// setAside keeps rec, which could not be parsed (parseErr), in the
// unparsable table, byte for byte: bytea keeps a NUL byte and bytes that
// are not UTF-8, which text cannot hold. A record set aside before (a
// re-delivery) is left as it is.
func (ib *Inbox) setAside(ctx context.Context, db Beginner, rec RawRecord, parseErr error) error {
	keys := make([][]byte, len(rec.Headers))
	values := make([][]byte, len(rec.Headers))
	for i, h := range rec.Headers {
		keys[i], values[i] = h.Key, h.Value
		if keys[i] == nil {
			keys[i] = []byte{}
		}
		if values[i] == nil {
			values[i] = []byte{}
		}
	}
	// The error quotes the record's own bytes at times; text holds
	// neither a NUL byte nor bytes that are not UTF-8.
	msg := strings.ToValidUTF8(strings.ReplaceAll(parseErr.Error(), "\x00", `\x00`), "\uFFFD")
	where := fmt.Sprintf("%s partition %d offset %d", rec.Topic, rec.Partition, rec.Offset)
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("set aside unparsable record at %s (%w): begin: %w", where, parseErr, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	tag, err := tx.Exec(ctx, `INSERT INTO `+ib.tables.unparsable()+`
		(consumer, topic, partition, "offset", record_key, record_value, header_keys, header_values, error, set_aside_at, record_sha256)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING`,
		ib.cfg.Consumer, rec.Topic, rec.Partition, rec.Offset, rec.Key, rec.Value, keys, values, msg, ib.cfg.Now(), recordDigest(rec.Key, rec.Value, keys, values))
	if err != nil {
		return fmt.Errorf("set aside unparsable record at %s (%w): %w%s", where, parseErr, err, missingTableHint(err))
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("set aside unparsable record at %s (%w): commit: %w", where, parseErr, err)
	}
	if tag.RowsAffected() > 0 {
		ib.m.unparsable.Add(1)
		if ib.cfg.OnUnparsable != nil {
			ib.cfg.OnUnparsable(rec, parseErr)
		}
	}
	return nil
}

// recordDigest is the SHA-256 of a record's key, value and headers, each
// part length-prefixed so that no two records share one by where their
// parts end; a nil key or value differs from an empty one.
func recordDigest(key, value []byte, headerKeys, headerValues [][]byte) []byte {
	h := sha256.New()
	part := func(b []byte) {
		n := int64(len(b))
		if b == nil {
			n = -1
		}
		_ = binary.Write(h, binary.BigEndian, n)
		h.Write(b)
	}
	part(key)
	part(value)
	for i := range headerKeys {
		part(headerKeys[i])
		part(headerValues[i])
	}
	return h.Sum(nil)
}
