package replication

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/pg"
)

// Issue 40.9: for the messages source, a dropped or invalidated slot said
// to run `reconcile ... --republish` (refused in this mode) or to
// reconcile the outbox table, which does not exist. Each source gets
// advice that is true for it: the table source reconciles; the messages
// source is told that the gap's events exist nowhere else and that the
// writers must emit them again.
func TestSlotGapAdviceFitsTheSource(t *testing.T) {
	lost := "lost"
	info := &SlotInfo{Name: "s", Plugin: "pgoutput", WALStatus: &lost}
	since := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	for _, messages := range []bool{false, true} {
		cfg := Config{Config: pg.Config{DSN: "postgres://db/app", Table: "public.outbox_events"}, Slot: "s"}
		if messages {
			cfg.Source = MessageSource{Prefix: "outbox"}
		}
		a := &Admin{cfg: cfg}
		invalidated := a.CheckSlot(context.Background(), info)
		if !errors.Is(invalidated, ErrSlotLost) {
			t.Fatalf("CheckSlot of a lost slot: %v", invalidated)
		}
		for _, c := range []struct {
			what, msg   string
			table, msgs []string // what the message says for each source
		}{
			{"missing", a.missingSlotError(since).Error(),
				[]string{"--on-slot-lost recover", "--existing-rows pending", "2026-11-30T12:00:00Z"},
				[]string{"migrate --source messages", "exist only in the WAL", "emit them again", "since 2026-11-30T12:00:00Z", "this source writes none"}},
			{"invalidated", invalidated.Error(),
				[]string{"--existing-rows pending", "--recreate-lost-slot", "--on-slot-lost recover"},
				[]string{"--recreate-lost-slot", "exist only in the WAL", "emit them again", "this source writes none"}},
			{"lost at START_REPLICATION", cfg.lostSlotAdvice("s"),
				[]string{"--existing-rows pending", "--recreate-lost-slot", "--on-slot-lost recover"},
				[]string{"--recreate-lost-slot", "exist only in the WAL", "emit them again", "this source writes none"}},
		} {
			want, not := c.table, []string{"emit them again"}
			if messages {
				want, not = c.msgs, []string{"reconcile --", "Reconcile the outbox", "reconcile the outbox", "--republish", "outbox_events"}
			}
			for _, w := range want {
				if !strings.Contains(c.msg, w) {
					t.Errorf("messages %v, %s slot: %q does not say %q", messages, c.what, c.msg, w)
				}
			}
			for _, n := range not {
				if strings.Contains(c.msg, n) {
					t.Errorf("messages %v, %s slot: %q says %q", messages, c.what, c.msg, n)
				}
			}
		}
	}
}
