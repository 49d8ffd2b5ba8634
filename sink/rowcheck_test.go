package sink

import (
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/lsn"
)

// Issue 40.9: a message whose content is no event got the advice of a
// table's row written under a missing column: "the row is still in the
// outbox table ... UPDATE ... FROM the outbox table". A message has no
// row anywhere; its advice says the quarantine row is its only copy.
func TestBadContentAdviceFitsMessages(t *testing.T) {
	ev := &event.Event{EventID: []byte("0b5a1d64-8b0e-4c7a-9c53-1d2e3f405162")}
	content := BadContent(ev, "message content is not an outbox event: not valid JSON", lsn.LSN(0x1000))
	row := UnmappedRow(ev, "outbox table public.outbox_events had no column payload", lsn.LSN(0x1000))
	if a := content.Advice(); strings.Contains(a, "outbox table") || !strings.Contains(a, "only copy") || !strings.Contains(a, "content_problem") ||
		!strings.Contains(a, "quarantine replay") || !strings.Contains(content.Error(), "the message is at WAL position 0/1000") {
		t.Errorf("bad content: %q; advice %q", content, a)
	}
	if a := row.Advice(); !strings.Contains(a, "still in the outbox table") {
		t.Errorf("unmapped row: advice %q", a)
	}
}
