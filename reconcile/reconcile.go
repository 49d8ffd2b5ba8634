// Package reconcile compares the outbox table with what Kafka holds and
// republishes what is missing.
//
// For a window of created_at it reads the window's event ids from the table
// as a stream into a sorted set of 16-byte values, reads every partition of
// every topic those rows route to from the offset of (since - margin) up to
// the high watermark taken at the start, and matches records to rows by
// their event_id header. Memory grows with the window's rows (20 bytes a
// row), never with the topics' history.
package reconcile

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/store"
)

// Config is one comparison.
type Config struct {
	Postgres pg.Config
	Kafka    publisher.Config

	// Quarantine is the quarantine table; rows held there are reported as
	// quarantined, not missing. A zero Table means none.
	Quarantine store.Table

	// Since and Until bound the rows compared by created_at: [Since, Until).
	Since, Until time.Time

	// Margin is how far before Since each partition is read, and how long
	// after the oldest row a record must be to count as a phantom. It
	// covers clock skew between PostgreSQL and the producer's host.
	Margin time.Duration

	// Stall is how long a partition may deliver nothing before it reaches
	// the high watermark taken at the start; then the check fails.
	Stall time.Duration

	Republish Republish

	// Snapshot, when set, is an exported snapshot (pg_export_snapshot, or
	// a slot's): every read of the outbox table happens in it, so the
	// comparison sees exactly the transactions it sees. A replication
	// slot's snapshot makes the window end at the slot's consistent point.
	Snapshot string
	// HeldSince, when set, is a time the table must still hold a row from:
	// a table whose oldest row is newer lost rows to a deletion that
	// reached into the window, and Run fails with ErrWindowDeleted before
	// republishing anything.
	HeldSince time.Time

	// Progress, when set, is called every ProgressEvery with what is done.
	Progress      func(Progress)
	ProgressEvery time.Duration
}

// Republish says whether and how missing events are sent again.
type Republish struct {
	Enabled bool
	// Quarantine stores events Kafka will never accept in the quarantine
	// table, as `run` does with --on-permanent-error quarantine; otherwise
	// they count as failed.
	Quarantine bool
	// AckTimeout bounds the wait for Kafka's acknowledgements.
	AckTimeout time.Duration
}

// Progress is a snapshot of a long comparison.
type Progress struct {
	Phase   string // "rows", "kafka" or "republish"
	Done    int64
	Total   int64 // 0 when unknown
	Elapsed time.Duration
	// WaitingOn says what Kafka has not answered yet (connecting, reading
	// offsets, records or acknowledgements that stopped coming); empty
	// while the comparison is not waiting on Kafka.
	WaitingOn string
}

// Phantom is a record in the window whose event_id has no row in the table.
type Phantom struct {
	EventID   EventID   `json:"event_id"`
	Topic     string    `json:"topic"`
	Partition int32     `json:"partition"`
	Offset    int64     `json:"offset"`
	Timestamp time.Time `json:"timestamp"`
}

// Failure is a missing event that republish could not deliver.
type Failure struct {
	EventID EventID `json:"event_id"`
	Error   string  `json:"error"`
	// Permanent says Kafka refused the event for good (an invalid topic, a
	// record too large): sending it again cannot help.
	Permanent bool `json:"permanent,omitempty"`
}

// Report is the outcome of a comparison.
type Report struct {
	Since  time.Time `json:"since"`
	Until  time.Time `json:"until"`
	Topics []string  `json:"topics"`

	RowsChecked    int64 `json:"rows_checked"`
	Found          int64 `json:"found"`
	RecordsScanned int64 `json:"records_scanned"`

	// Missing are the window's rows with no record and not quarantined.
	Missing []EventID `json:"missing"`
	// Duplicated are rows with more than one record.
	Duplicated []EventID `json:"delivered_more_than_once"`
	// Quarantined are rows with no record that the quarantine table holds
	// and replay has not delivered yet.
	Quarantined []EventID `json:"quarantined"`
	// ReplayedNotFound are rows `quarantine replay` delivered (Kafka
	// acknowledged them to the topic the quarantine table records) whose
	// record was not read back there, e.g. retention deleted it. They are
	// not missing and never republished. A replayed record that was read
	// back counts as found.
	ReplayedNotFound []EventID `json:"replayed_not_found"`
	Phantoms         []Phantom `json:"phantoms"`

	// UncheckedRows have an event_id that is not a uuid, so no record can
	// be matched to them; UnidentifiedRecords are records in the phantom
	// window whose event_id header is absent or not a uuid.
	UncheckedRows       int64 `json:"unchecked_rows"`
	UnidentifiedRecords int64 `json:"unidentified_records"`

	// MissingTopics are topics rows route to that Kafka does not have.
	MissingTopics []string `json:"missing_topics"`
	// TruncatedPartitions lost records to Kafka's retention and the window
	// reaches back to what is left: their rows may show as missing.
	TruncatedPartitions []string `json:"truncated_partitions"`

	// What --republish did with Missing.
	Republished          int64     `json:"republished"`
	RepublishQuarantined []EventID `json:"republish_quarantined"`
	RepublishFailed      []Failure `json:"republish_failed"`

	Elapsed time.Duration `json:"elapsed_ns"`
}

// Unrepaired is how many missing events are still missing.
func (r *Report) Unrepaired() int64 { return int64(len(r.Missing)) - r.Republished }

// MarshalJSON writes every empty list as [], never null, so a script can
// iterate over any field without a check.
func (r Report) MarshalJSON() ([]byte, error) {
	type plain Report // without this method
	p := plain(r)
	orEmpty(&p.Topics)
	orEmpty(&p.Missing)
	orEmpty(&p.Duplicated)
	orEmpty(&p.Quarantined)
	orEmpty(&p.ReplayedNotFound)
	orEmpty(&p.Phantoms)
	orEmpty(&p.MissingTopics)
	orEmpty(&p.TruncatedPartitions)
	orEmpty(&p.RepublishQuarantined)
	orEmpty(&p.RepublishFailed)
	return json.Marshal(p)
}

func orEmpty[T any](s *[]T) {
	if *s == nil {
		*s = []T{}
	}
}

// ErrBadWindow marks a window that cannot be compared.
var ErrBadWindow = errors.New("bad window")

// ErrWindowDeleted marks a window some of whose rows were deleted from the
// table: what they held cannot be compared or republished.
var ErrWindowDeleted = errors.New("rows of the window were deleted")

// counters are what progress reports, updated by the workers.
type counters struct {
	phase   atomic.Pointer[string]
	done    atomic.Int64
	total   atomic.Int64
	waiting atomic.Pointer[string]
}

func (c *counters) enter(phase string, total int64) {
	c.done.Store(0)
	c.total.Store(total)
	c.phase.Store(&phase)
	c.waitOn("")
}

// waitOn names the Kafka call the comparison is blocked in; "" when none.
func (c *counters) waitOn(what string) { c.waiting.Store(&what) }

// Run compares the window and, when asked, republishes what is missing.
func Run(ctx context.Context, cfg Config, log zerolog.Logger) (*Report, error) {
	if !cfg.Since.Before(cfg.Until) {
		return nil, fmt.Errorf("%w: since %s is not before until %s", ErrBadWindow,
			cfg.Since.UTC().Format(time.RFC3339), cfg.Until.UTC().Format(time.RFC3339))
	}
	started := time.Now()
	rep := &Report{Since: cfg.Since.UTC(), Until: cfg.Until.UTC()}

	var progress counters
	progress.enter("rows", 0)
	if cfg.Progress != nil {
		stop := reportProgress(cfg, &progress, started)
		defer stop()
	}

	table, err := openTable(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer table.close()

	topics, rowTotal, err := table.topics(ctx)
	if err != nil {
		return nil, err
	}
	replayedTo, err := table.replayedTopics(ctx)
	if err != nil {
		return nil, err
	}
	for _, topic := range replayedTo {
		if !slices.Contains(topics, topic) {
			topics = append(topics, topic)
		}
	}
	slices.Sort(topics)
	rep.Topics = topics
	progress.enter("rows", rowTotal)
	rows, unchecked, err := table.windowIDs(ctx, rowTotal, &progress.done)
	if err != nil {
		return nil, err
	}
	rep.RowsChecked = int64(len(rows.ids)) + unchecked
	rep.UncheckedRows = unchecked
	if unchecked > 0 {
		log.Warn().Int64("rows", unchecked).
			Msg("rows whose event_id is not a uuid cannot be matched to records; they are counted as unchecked")
	}

	oldest, err := table.oldestRow(ctx)
	if err != nil {
		return nil, err
	}
	if err := checkHeld(cfg, oldest); err != nil {
		return nil, err
	}
	// Records older than the oldest row (plus the margin) may belong to
	// rows retention deleted, so only younger ones can be phantoms; an
	// empty table vouches for no record at all.
	phantomSince := cfg.Since
	switch later := oldest.Add(cfg.Margin); {
	case oldest.IsZero():
		phantomSince = cfg.Until
	case later.After(phantomSince):
		phantomSince = later
	}

	scan, err := scanKafka(ctx, cfg, topics, rows, phantomSince, &progress, log)
	if err != nil {
		return nil, err
	}
	rep.RecordsScanned = scan.records
	rep.UnidentifiedRecords = scan.unidentified
	rep.MissingTopics = scan.missingTopics
	rep.TruncatedPartitions = scan.truncated

	rep.Phantoms, err = table.phantoms(ctx, scan.candidates)
	if err != nil {
		return nil, err
	}

	var absent sortedIDs
	for i := range rows.ids {
		switch n := rows.counts[i].Load(); {
		case n == 0:
			absent = append(absent, rows.ids[i])
		case n > 1:
			rep.Duplicated = append(rep.Duplicated, rows.ids[i])
			rep.Found++
		default:
			rep.Found++
		}
	}
	rows = nil // the set is done with; let a long republish run without it
	rep.Missing, rep.Quarantined, rep.ReplayedNotFound, err = table.splitQuarantined(ctx, absent)
	if err != nil {
		return nil, err
	}

	if cfg.Republish.Enabled && len(rep.Missing) > 0 {
		progress.enter("republish", int64(len(rep.Missing)))
		if err := republish(ctx, cfg, table, rep, &progress, log); err != nil {
			return rep, err
		}
	}
	rep.Elapsed = time.Since(started)
	return rep, nil
}

// CheckTable makes sure Run can compare cfg's window: the table and its
// columns exist and can be read, and it still holds a row from
// cfg.HeldSince. It changes nothing.
func CheckTable(ctx context.Context, cfg Config) error {
	table, err := openTable(ctx, cfg)
	if err != nil {
		return err
	}
	defer table.close()
	oldest, err := table.oldestRow(ctx)
	if err != nil {
		return err
	}
	return checkHeld(cfg, oldest)
}

// checkHeld fails when the table's oldest row, created at oldest (zero:
// none), is newer than cfg.HeldSince.
func checkHeld(cfg Config, oldest time.Time) error {
	if cfg.HeldSince.IsZero() || !oldest.IsZero() && !oldest.After(cfg.HeldSince) {
		return nil
	}
	found := "the table is empty"
	if !oldest.IsZero() {
		found = "its oldest row was created at " + oldest.UTC().Format(time.RFC3339Nano)
	}
	return fmt.Errorf("%w: %s must still hold a row created at or before %s, but %s: rows were deleted (by a retention job, a partition drop or by hand) past that point, so events of the window may be gone for good",
		ErrWindowDeleted, cfg.Postgres.Table, cfg.HeldSince.UTC().Format(time.RFC3339Nano), found)
}

// reportProgress calls cfg.Progress on a ticker until the returned stop.
func reportProgress(cfg Config, c *counters, started time.Time) (stop func()) {
	every := cfg.ProgressEvery
	if every <= 0 {
		every = 10 * time.Second
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		tick := time.NewTicker(every)
		defer tick.Stop()
		var last Progress
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				p := Progress{Phase: *c.phase.Load(), Done: c.done.Load(), Total: c.total.Load(), Elapsed: time.Since(started),
					WaitingOn: *c.waiting.Load()}
				if p.WaitingOn == "" && p.Phase == last.Phase && p.Done == last.Done && p.Done < p.Total {
					// Reading partitions or awaiting acks, and nothing came
					// since the last report.
					switch p.Phase {
					case "kafka":
						p.WaitingOn = "records: no partition delivered any since the last report"
					case "republish":
						p.WaitingOn = "acknowledgements: none arrived since the last report"
					}
				}
				last = p
				cfg.Progress(p)
			}
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}
