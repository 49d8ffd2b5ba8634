// Package inbox applies events from the relay exactly once, as far as the
// consumer's own database is concerned. At-least-once delivery re-delivers
// events after crashes and restarts, and a consumer that crashes after its
// database commit but before its Kafka offset commit sees the same records
// again, in either delivery mode. So each event is applied in one local
// transaction that also records its event_id in a processed-events table:
// a re-delivered event finds its record and is skipped, and an error rolls
// back the record together with the effect.
//
// The record must live in the same database, and commit in the same
// transaction, as the side effect; a record kept elsewhere (a cache, another
// database) brings back the dual write the outbox removed. It must also be
// kept at least as long as any event can be re-delivered: see Prune.
//
// Optionally the inbox checks each aggregate's version (the
// aggregate_version header the writer in package outbox sets): a version
// already applied is skipped, one that skips a version is held back until
// its predecessor arrives (or refused), and a predecessor missing for
// longer than a limit is reported; SkipMissing releases what waits for a
// version that will never come. A held event is kept as it arrived, its
// payload and headers byte for byte (SQL upgrades tables an older version
// created). Records without an aggregate type (CloudEvents, Debezium's
// shape) use the versions of their aggregate id, so a switch of record
// format keeps every aggregate's order.
//
// A record no event can be read from is set aside in a table of its own,
// byte for byte, and its partition goes on (ApplyInOrder with
// Records.Raw, as both adapters do).
//
// A record whose headers carry a W3C traceparent (the relay writes its
// own span's there when tracing is on) is handled under a consumer span,
// that span's child, which says the outcome (applied, duplicate, stale,
// parked) and the aggregate version; the handler's ctx carries it, so the
// handler's own spans join the trace. Config.TracerProvider chooses the
// provider. The inbox_occurred_to_applied_seconds histogram times each
// applied event from its occurred_at header.
//
// The core takes any Kafka client's key, headers and value, in every
// record format the relay writes (ParseRecord). Package
// inboxsarama adapts it to a sarama consumer group and marks each offset
// only after the event's transaction committed; package inboxkgo does the
// same for franz-go. Both go through HandleBatch, so both trace alike.
package inbox

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
)

// Handler applies one event using tx, the transaction that also records
// it. It must do all its database work through tx and must not commit or
// roll it back (tx.Commit and tx.Rollback return ErrHandlerEndedTx, and a
// COMMIT or ROLLBACK sent as SQL fails the event). An error rolls back the
// record and every effect; so does a statement that failed while the
// handler returned nil, since it aborted the transaction.
type Handler func(ctx context.Context, tx pgx.Tx, ev Event) error

// Beginner starts a transaction: *pgx.Conn, *pgxpool.Pool and pgx.Tx
// (a savepoint) all are.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// GapPolicy says what happens to an event whose aggregate version skips
// one.
type GapPolicy int

const (
	// HoldGaps records the event and parks it; it is applied in the same
	// transaction as its predecessor, once that arrives. The consumer
	// moves on to later records meanwhile.
	HoldGaps GapPolicy = iota
	// RefuseGaps returns ErrVersionGap and records nothing, so the event
	// comes back on the next delivery. With a Kafka consumer that retries
	// (inboxsarama) the partition stops until an operator acts: the
	// predecessor of an event can only arrive later on the same partition.
	RefuseGaps
)

// ErrVersionGap is returned, wrapped, for a refused gap (RefuseGaps).
var ErrVersionGap = errors.New("aggregate version gap")

// Config configures an Inbox.
type Config struct {
	// Consumer names this consumer. Different consumers of the same
	// events, even sharing the tables, each apply every event once.
	Consumer string
	// Tables are the inbox's tables (see SQL).
	Tables Tables
	// CheckVersions turns on the per-aggregate version checks. Events
	// without the aggregate_version header are applied without a check.
	CheckVersions bool
	// Gaps is the policy for a version that skips one.
	Gaps GapPolicy
	// MissingAfter is how long an event may wait for its predecessor
	// before the predecessor is reported missing; default 5 minutes.
	MissingAfter time.Duration
	// OnMissingPredecessor, if set, is called (outside any transaction)
	// when Handle parks an event whose aggregate has waited longer than
	// MissingAfter. Overdue lists all such aggregates.
	OnMissingPredecessor func(Missing)
	// RetentionFloor is the youngest age Prune will delete: the topics'
	// retention plus the longest replay you expect (a reconcile
	// --republish window, a consumer reset to an old offset). Prune
	// refuses to run without it.
	RetentionFloor time.Duration
	// OnUnparsable, if set, is called (outside any transaction) for each
	// record set aside because no event could be read from it, once it is
	// in the unparsable table: alert from here, or from the
	// inbox_unparsable_records_total counter.
	OnUnparsable func(rec RawRecord, err error)
	// Metrics, if set, counts outcomes.
	Metrics *Metrics
	// Now is the clock for parked events and the missing limit; default
	// time.Now.
	Now func() time.Time
	// TracerProvider makes the consumer span of each event whose record
	// carries a W3C traceparent header: a child of the relay's span,
	// around the handler, with the outcome. Default: the global provider
	// (otel.GetTracerProvider), a no-op unless the application set one.
	TracerProvider trace.TracerProvider
}

// Outcome is what Handle did with an event.
type Outcome int

const (
	// Applied: the handler ran and committed.
	Applied Outcome = iota + 1
	// Duplicate: the event_id was recorded already; nothing ran.
	Duplicate
	// Stale: the aggregate had this version already, applied or parked
	// under another event_id; recorded, nothing ran.
	Stale
	// Parked: the predecessor is missing; the event waits (HoldGaps).
	Parked
)

func (o Outcome) String() string {
	switch o {
	case Applied:
		return "applied"
	case Duplicate:
		return "duplicate"
	case Stale:
		return "stale"
	case Parked:
		return "parked"
	}
	return "unknown"
}

// Result reports one Handle call.
type Result struct {
	Outcome Outcome
	// Released counts parked successors applied in the same transaction.
	Released int
}

// Missing is an aggregate waiting for a version.
type Missing struct {
	AggregateType, AggregateID string
	// Applied is the last version applied; Waiting the lowest version
	// parked, so the versions in between are missing.
	Applied, Waiting int64
	// Since is when the oldest parked event of the aggregate arrived.
	Since time.Time
}

// Inbox applies events once per consumer.
type Inbox struct {
	cfg    Config
	tables Tables
	m      *Metrics
	tracer trace.Tracer
}

// New checks cfg and returns an Inbox.
func New(cfg Config) (*Inbox, error) {
	if cfg.Consumer == "" {
		return nil, errors.New("inbox: Config.Consumer is empty; name the consumer (e.g. the service and its purpose)")
	}
	if strings.ContainsRune(cfg.Consumer, 0) || !utf8.ValidString(cfg.Consumer) {
		// Every row the inbox writes carries it, in a text column, so
		// every record would fail for ever.
		return nil, fmt.Errorf("inbox: Config.Consumer %q holds a NUL byte or bytes that are not UTF-8, which PostgreSQL text cannot store; name the consumer in plain text", cfg.Consumer)
	}
	t := cfg.Tables.withDefaults()
	if err := t.validate(); err != nil {
		return nil, err
	}
	if cfg.MissingAfter <= 0 {
		cfg.MissingAfter = 5 * time.Minute
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Gaps != HoldGaps && cfg.Gaps != RefuseGaps {
		return nil, fmt.Errorf("inbox: Config.Gaps %d: want HoldGaps or RefuseGaps", cfg.Gaps)
	}
	m := cfg.Metrics
	if m == nil {
		m = NewMetrics(cfg.Consumer) // counted, just not exported
	}
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return &Inbox{cfg: cfg, tables: t, m: m, tracer: tp.Tracer(tracerName)}, nil
}

// Metrics returns the inbox's counters.
func (ib *Inbox) Metrics() *Metrics { return ib.m }

// Handle applies ev once: in one transaction begun on db it records the
// event_id, skips a duplicate, checks the version if configured, runs h and
// commits. Any error rolls everything back; then the event was not applied
// and must be handled again (do not commit its offset). HandleBatch does
// the same for a run of events in one transaction.
func (ib *Inbox) Handle(ctx context.Context, db Beginner, ev Event, h Handler) (Result, error) {
	res, err := ib.HandleBatch(ctx, db, []Event{ev}, h)
	if err != nil {
		return Result{}, err
	}
	return res[0], nil
}

// ErrHandlerEndedTx is returned, wrapped and naming the event, when a
// handler committed or rolled back the transaction it was given: that
// transaction also records the batch's events, so ending it early would
// record events whose handlers never ran. The handler's tx.Commit and
// tx.Rollback are refused with it, and so is SQL through tx that would end
// the transaction (txguard.go); a COMMIT or ROLLBACK sent past the wrapper
// is noticed when the handler returns.
var ErrHandlerEndedTx = errors.New("the handler ended the inbox's transaction (commit or rollback); leave that to the inbox, " +
	"and for a step that may fail on its own use a savepoint (tx.Begin) and roll that back")

// errSwallowed is a handler's nil return over a statement that failed.
var errSwallowed = errors.New("returned nil, but a statement in its transaction failed, which aborted the transaction; " +
	"return that statement's error, or run the statement in a savepoint (tx.Begin) and roll that back")

// handlerTx is the transaction a handler gets: the inbox's own, which
// only the inbox may end.
type handlerTx struct {
	pgx.Tx
	ended bool
}

func (t *handlerTx) Commit(context.Context) error   { t.ended = true; return ErrHandlerEndedTx }
func (t *handlerTx) Rollback(context.Context) error { t.ended = true; return ErrHandlerEndedTx }

func (ib *Inbox) run(ctx context.Context, tx pgx.Tx, ev Event, h Handler) error {
	htx := &handlerTx{Tx: tx}
	err := h(ctx, htx, ev)
	// The connection's transaction status, as of the last answer the
	// server sent: no round trip.
	status := byte('T')
	if c := tx.Conn(); c != nil {
		status = c.PgConn().TxStatus()
	}
	switch {
	case status == 'I':
		// A COMMIT or ROLLBACK sent as SQL: the server's transaction is
		// gone, whatever pgx believes.
		return &handlerError{id: ev.ID, err: ErrHandlerEndedTx, endedBySQL: true}
	case htx.ended:
		return &handlerError{id: ev.ID, err: ErrHandlerEndedTx}
	case err != nil:
		return &handlerError{id: ev.ID, err: err}
	case status == 'E':
		return &handlerError{id: ev.ID, err: errSwallowed}
	}
	return nil
}

// handlerError marks an error as the handler's, so it is counted once, when
// it is final, however often the batch was tried.
type handlerError struct {
	id  string
	err error
	// endedBySQL: the handler's SQL ended the transaction, which may have
	// committed the batch's records with it.
	endedBySQL bool
}

func (e *handlerError) Error() string { return fmt.Sprintf("event %s: handler: %v", e.id, e.err) }
func (e *handlerError) Unwrap() error { return e.err }

// endedBySQL reports whether err says a handler ended the transaction
// through SQL.
func endedBySQL(err error) bool {
	var he *handlerError
	return errors.As(err, &he) && he.endedBySQL
}

// park keeps an event until its predecessor arrives, and reports the
// aggregate when its oldest parked event has waited past the limit. It
// parks nothing, and says so, when another event of the aggregate is
// parked with the same version: versions are unique per aggregate, so the
// writer broke its contract, and the later event is as stale as one whose
// version was applied already.
func (ib *Inbox) park(ctx context.Context, tx pgx.Tx, a aggregate, ev Event, applied int64) (bool, *Missing, error) {
	// bytea keeps every byte of a header (a Go string may hold any), and
	// a nil payload stays NULL, so the event comes back as it arrived.
	keys := make([][]byte, 0, len(ev.Headers))
	values := make([][]byte, 0, len(ev.Headers))
	for k, v := range ev.Headers {
		keys, values = append(keys, []byte(k)), append(values, []byte(v))
	}
	now := ib.cfg.Now()
	tag, err := tx.Exec(ctx, `INSERT INTO `+ib.tables.parked()+`
		(consumer, aggregate_type, aggregate_id, version, event_id, event_type, payload, header_keys, header_values, parked_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT DO NOTHING`,
		ib.cfg.Consumer, a.typ, a.id, ev.Version, ev.ID, ev.EventType, ev.Payload, keys, values, now)
	if err != nil {
		return false, nil, fmt.Errorf("event %s: park: %w", ev.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return false, nil, nil
	}
	m := Missing{AggregateType: a.typ, AggregateID: a.id, Applied: applied}
	if err := tx.QueryRow(ctx, `SELECT min(version), min(parked_at) FROM `+ib.tables.parked()+`
		WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3`,
		ib.cfg.Consumer, a.typ, a.id).Scan(&m.Waiting, &m.Since); err != nil {
		return false, nil, fmt.Errorf("event %s: park: %w", ev.ID, err)
	}
	if now.Sub(m.Since) < ib.cfg.MissingAfter {
		return true, nil, nil
	}
	return true, &m, nil
}

// release applies, in order, the parked successors of aggregate a's
// version (applied by event id, or skipped), and returns how many and the
// last version applied. A released event is handed to the handler with
// a's type, the one its versions are kept under.
func (ib *Inbox) release(ctx context.Context, tx pgx.Tx, a aggregate, version int64, id string, h Handler) (int, int64, error) {
	last := version
	released := 0
	for {
		next := Event{AggregateType: a.typ, AggregateID: a.id, Version: last + 1}
		var keys, values [][]byte
		err := tx.QueryRow(ctx, `DELETE FROM `+ib.tables.parked()+`
			WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND version = $4
			RETURNING event_id, event_type, payload, header_keys, header_values`,
			ib.cfg.Consumer, a.typ, a.id, next.Version).Scan(&next.ID, &next.EventType, &next.Payload, &keys, &values)
		if errors.Is(err, pgx.ErrNoRows) {
			return released, last, nil
		}
		if err != nil {
			return 0, 0, fmt.Errorf("event %s: release version %d: %w", id, next.Version, err)
		}
		if len(keys) != len(values) {
			return 0, 0, fmt.Errorf("event %s: release version %d: %d header keys, %d values", id, next.Version, len(keys), len(values))
		}
		next.Headers = make(map[string]string, len(keys))
		for i := range keys {
			next.Headers[string(keys[i])] = string(values[i])
		}
		if err := ib.run(ctx, tx, next, h); err != nil {
			return released, next.Version, err
		}
		released++
		last = next.Version
	}
}

// Querier runs statements: *pgx.Conn, *pgxpool.Pool and pgx.Tx all are.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// missingTableHint says what to do when a statement failed because a
// table is missing (SQLSTATE 42P01): tables a newer version added are
// created by applying SQL again.
func missingTableHint(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
		return " (apply inbox.SQL again: it creates the tables this version added, and leaves existing ones as they are)"
	}
	return ""
}

// IsNil reports whether db is nil, or an interface holding a nil pointer
// (a *pgxpool.Pool never opened), which would panic on the first record
// inside a consumer's goroutine, where the caller cannot recover it.
func IsNil(db Beginner) bool {
	if db == nil {
		return true
	}
	v := reflect.ValueOf(db)
	switch v.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan:
		return v.IsNil()
	}
	return false
}
