package progress

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// Store is where progress records are kept: publisher's ProgressStore,
// the progress topic in Kafka.
type Store interface {
	// Topic names where the records are, for the operator.
	Topic() string
	// Latest reads key's newest record; found is false when it has none.
	// A topic the brokers lost is ErrTopicMissing.
	Latest(ctx context.Context, key []byte) (rec Record, found bool, err error)
	// Write stores a record for key.
	Write(key []byte, r Record) error
	// Recreate makes a topic the brokers lost again; created says it was
	// missing.
	Recreate(ctx context.Context) (created bool, err error)
	Close() error
}

// Writer writes the newest offered record to the store at most once per
// interval, on a goroutine of its own, so that the relay's read loop never
// waits on Kafka for it. It writes only what it is offered: the caller
// offers positions whose events Kafka already acknowledged, so the record
// never leads. It tells written of each record it stored, on its own
// goroutine, so what was stored is settled where it was written, not
// carried back through the caller's loop.
type Writer struct {
	store Store
	every time.Duration
	log   zerolog.Logger
	// written is told of each record Kafka stored; nil tells nobody.
	written func(Record)

	mu      sync.Mutex
	key     []byte
	pending Record
	dirty   bool // pending differs from what was last written
	wake    chan struct{}
	flushes chan chan error // Flush's requests, answered once the write ended
	stop    chan struct{}
	done    chan struct{}
	closing sync.Once
	lastErr error // the last write's error; only the loop touches it
}

// NewWriter starts a writer on the store; Close stops it. written, when
// not nil, is called with each record stored, on the writer's goroutine:
// it must not wait for the writer.
func NewWriter(s Store, every time.Duration, log zerolog.Logger, written func(Record)) *Writer {
	w := &Writer{store: s, every: every, log: log, written: written,
		wake: make(chan struct{}, 1), flushes: make(chan chan error), stop: make(chan struct{}), done: make(chan struct{})}
	go w.loop()
	return w
}

// Offer hands the writer the newest confirmed position for key. It never
// blocks: a record not yet written is replaced by a newer one.
func (w *Writer) Offer(key []byte, r Record) {
	w.mu.Lock()
	if r == w.pending && bytes.Equal(key, w.key) {
		w.mu.Unlock()
		return
	}
	w.key, w.pending, w.dirty = key, r, true
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// Flush writes what is pending now and returns once the store took it, or
// failed to: a record the caller then writes to the store itself lands
// after every record offered before. ctx bounds the wait.
func (w *Writer) Flush(ctx context.Context) error {
	reply := make(chan error, 1)
	select {
	case w.flushes <- reply:
	case <-w.done:
		return nil // closed: nothing is pending any more
	case <-ctx.Done():
		return fmt.Errorf("flush the progress writer: %w", ctx.Err())
	}
	select {
	case err := <-reply:
		return err
	case <-ctx.Done():
		return fmt.Errorf("flush the progress writer: %w", ctx.Err())
	}
}

// Close writes what is pending, waiting at most timeout, then stops the
// writer. It does not close the store.
func (w *Writer) Close(timeout time.Duration) {
	w.closing.Do(func() { close(w.stop) })
	select {
	case <-w.done:
	case <-time.After(timeout):
		w.log.Warn().Dur("timeout", timeout).
			Msg("gave up writing the last progress record; the next start re-delivers from the previous one")
	}
}

func (w *Writer) loop() {
	defer close(w.done)
	pause := time.NewTimer(w.every)
	pause.Stop()
	defer pause.Stop()
	// While the interval after a write runs, wake is nil and resume is
	// the timer's: at most one write per interval, however often
	// positions move. A Flush does not wait for the interval.
	wake, resume := w.wake, (<-chan time.Time)(nil)
	failing := false
	for {
		select {
		case <-w.stop:
			w.flush(&failing)
			return
		case reply := <-w.flushes:
			w.answer(reply, &failing)
		case <-resume:
			wake, resume = w.wake, nil
		case <-wake:
			if w.flush(&failing) {
				pause.Reset(w.every)
				wake, resume = nil, pause.C
			}
		}
	}
}

// remake makes a progress topic the brokers lost (deleted, or gone with a
// broker's data) again and writes rec once more. Left missing, no record
// would be stored until the stream restarted, and a PostgreSQL restart
// meanwhile would re-deliver everything since the last one.
func (w *Writer) remake(key []byte, rec Record) error {
	ctx, cancel := context.WithTimeout(context.Background(), remakeTimeout)
	defer cancel()
	created, err := w.store.Recreate(ctx)
	if err != nil {
		return fmt.Errorf("make the missing progress topic again: %w", err)
	}
	if created {
		w.log.Warn().Str("topic", w.store.Topic()).
			Msg("the progress topic was missing on the brokers (deleted, or lost with a broker's data); made it again and wrote the current position to it")
	}
	return w.store.Write(key, rec)
}

// remakeTimeout bounds making the progress topic again.
const remakeTimeout = 30 * time.Second

// answer serves a Flush: it writes what is pending and replies with the
// write's error, or nil when nothing was pending.
func (w *Writer) answer(reply chan<- error, failing *bool) {
	if w.flush(failing) {
		reply <- w.lastErr
		return
	}
	reply <- nil
}

// flush writes the pending record, if any, and reports whether it tried.
// A failed write stays pending for the next attempt: progress that is not
// written only widens what a restart re-delivers.
func (w *Writer) flush(failing *bool) bool {
	w.mu.Lock()
	if !w.dirty {
		w.mu.Unlock()
		return false
	}
	key, rec := w.key, w.pending
	w.dirty = false
	w.mu.Unlock()
	err := w.store.Write(key, rec)
	if errors.Is(err, ErrTopicMissing) {
		err = w.remake(key, rec)
	}
	w.lastErr = err
	if err != nil {
		w.mu.Lock()
		if !w.dirty {
			w.dirty = true // keep it for the next attempt unless a newer one came
		}
		w.mu.Unlock()
		select {
		case w.wake <- struct{}{}:
		default:
		}
		if !*failing {
			w.log.Warn().Err(err).Str("topic", w.store.Topic()).
				Msg("cannot write progress to Kafka; retrying every status interval. Until it succeeds, a PostgreSQL restart re-delivers everything since the last progress written")
		}
		*failing = true
		return true
	}
	if *failing {
		w.log.Info().Str("topic", w.store.Topic()).Msg("writing progress to Kafka again")
		*failing = false
	}
	if w.written != nil {
		w.written(rec)
	}
	return true
}
