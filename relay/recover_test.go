package relay

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/replication"
)

// The window a recovery of a lost slot compares starts at the commit time
// of the last event Kafka is known to hold, back by the retention margin
// for transactions open across it; a recovery that did not finish keeps the
// start it chose; and with nothing to start from the relay refuses, saying
// what to do, rather than guess.
func TestRecoveryWindow(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Retention.Margin = 30 * time.Minute
	r := New(cfg, zerolog.Nop(), nil, Hooks{})
	commit := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)

	since, held, err := r.recoveryWindow(&slotLoss{reason: "dropped", record: &progress.Record{LSN: 0x100, Timeline: 1, CommitTime: commit}})
	if err != nil || !since.Equal(commit.Add(-30*time.Minute)) || !held.Equal(commit) {
		t.Errorf("from the progress record: since %v, held %v, %v; want %v and %v", since, held, err, commit.Add(-30*time.Minute), commit)
	}

	marked := commit.Add(-2 * time.Hour)
	since, held, err = r.recoveryWindow(&slotLoss{reason: "unfinished", record: &progress.Record{LSN: 0x100, Timeline: 1, CommitTime: commit, RecoverySince: marked}})
	if err != nil || !since.Equal(marked) || !held.Equal(commit) {
		t.Errorf("an unfinished recovery: since %v, held %v, %v; want the mark %v and %v", since, held, err, marked, commit)
	}

	for name, loss := range map[string]*slotLoss{
		"no record":               {reason: "dropped"},
		"a record with no commit": {reason: "dropped", record: &progress.Record{LSN: 0x100, Timeline: 1}},
	} {
		_, _, err := r.recoveryWindow(loss)
		if !errors.Is(err, ErrSlotUnrecoverable) || !IsFatal(err) || !strings.Contains(err.Error(), "--existing-rows pending") {
			t.Errorf("%s: %v; want a refusal the operator can act on", name, err)
		}
	}

	// With no progress record, the slot's own record says since when its
	// events may be missing: since it was made, back by the margin.
	made := commit.Add(-24 * time.Hour)
	since, held, err = r.recoveryWindow(&slotLoss{reason: "dropped", made: &replication.SlotRecord{CreatedAt: made}})
	if err != nil || !since.Equal(made.Add(-30*time.Minute)) || !held.IsZero() {
		t.Errorf("from the slot's record: since %v, held %v, %v; want %v and none", since, held, err, made.Add(-30*time.Minute))
	}

	// --existing-rows pending takes the whole table, and so does a start
	// that finds the mark it left.
	for name, loss := range map[string]*slotLoss{
		"pending":             {reason: "dropped", wholeTable: true, record: &progress.Record{CommitTime: commit}},
		"pending, unfinished": {reason: "unfinished", record: &progress.Record{CommitTime: commit, RecoverySince: wholeTableSince}},
	} {
		since, held, err := r.recoveryWindow(loss)
		if err != nil || !since.IsZero() || !held.IsZero() {
			t.Errorf("%s: since %v, held %v, %v; want the whole table", name, since, held, err)
		}
	}
}

// Retention never deletes a row the progress record does not cover: its
// bound is the earlier of the confirmed commit and the record's, and none
// while either is unknown.
func TestRetentionBoundIsTheEarlierKnown(t *testing.T) {
	a := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	b := a.Add(time.Minute)
	for _, c := range []struct {
		x, y, want time.Time
	}{
		{a, b, a},
		{b, a, a},
		{a, time.Time{}, time.Time{}},
		{time.Time{}, b, time.Time{}},
	} {
		if got := earlier(c.x, c.y); !got.Equal(c.want) {
			t.Errorf("earlier(%v, %v) = %v, want %v", c.x, c.y, got, c.want)
		}
	}
}
