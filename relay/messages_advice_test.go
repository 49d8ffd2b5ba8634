package relay

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/replication"
)

// Issue 40.9: for the messages source, a lost publication advised
// `reconcile ... --republish` (refused in this mode), and creating or
// recreating the slot counted rows of an outbox table that does not exist
// and pointed at reconcile. Each source's advice is true for it.
func TestSlotAdviceFitsTheSource(t *testing.T) {
	for _, messages := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.Replication.Slot = "s"
		if messages {
			cfg.Replication.Source = replication.MessageSource{Prefix: "outbox"}
		}
		var logs bytes.Buffer
		r := New(cfg, zerolog.New(&logs), nil, Hooks{})
		gone := r.publicationGoneError(replication.ErrPublicationGone).Error()
		if messages {
			r.logSlotCreated(context.Background(), nil, replication.SlotStart{Created: true, RecreatedLost: true, LSN: 0x1000})
		}
		for what, msg := range map[string]string{"publication gone": gone, "slot created": logs.String()} {
			if !messages && what == "slot created" {
				continue // counts the outbox table: needs a database (test/e2e)
			}
			want, not := []string{"--on-slot-lost recover", "migrate --skip-slot"}, []string{"emit them again"}
			if messages {
				want = []string{"exist only in the WAL", "emit them again"}
				not = []string{"reconcile --", "reconcile_command", "rows_in_table", "count_error", "outbox table"}
				if what == "publication gone" {
					want = append(want, "migrate --source messages")
				}
			}
			for _, w := range want {
				if !strings.Contains(msg, w) {
					t.Errorf("messages %v, %s: %q does not say %q", messages, what, msg, w)
				}
			}
			for _, n := range not {
				if strings.Contains(msg, n) {
					t.Errorf("messages %v, %s: %q says %q", messages, what, msg, n)
				}
			}
		}
	}
}
