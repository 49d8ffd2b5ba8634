// Package pattern drills the whole outbox pattern, not only the relay: a
// service writes business rows and events with package outbox, the relay
// publishes them, and consumer processes apply them through package inbox,
// while the relay, PostgreSQL and the consumers crash. What it proves is
// the pattern's own promise: no committed business change is lost, and no
// side effect is applied twice.
//
// `go test ./test/pattern/` runs the reduced size; `make drills` sets
// OUTBOX_RELAY_DRILL_SIZE=full for the full one.
package pattern

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
