// Package drills holds the failure drills: each one runs the real relay
// binary against a private PostgreSQL and a Kafka (kfake in process, or
// Apache Kafka), breaks something on purpose, and proves from outside (with
// franz-go, never the relay's own sarama code) that nothing committed was
// lost and that per-aggregate order held wherever the relay promises it.
//
// `go test ./test/drills/` runs the reduced sizes; `make drills` sets
// OUTBOX_RELAY_DRILL_SIZE=full for the full ones.
package drills

import (
	"fmt"
	"os"
	"testing"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// shared is the PostgreSQL cluster the drills share when they do not need
// server settings of their own; each drill gets its own database, and so
// its own slot.
var shared *harness.Postgres

func TestMain(m *testing.M) {
	pg, _, err := harness.StartPostgresMain(harness.PGOptions{Settings: map[string]string{
		"wal_sender_timeout": "20s",
	}})
	if err != nil {
		fmt.Fprintf(os.Stderr, "drills: start postgres: %v\n", err)
		os.Exit(1)
	}
	shared = pg
	// Main stops everything the harness registered (the shared cluster,
	// relay processes, Apache Kafka clusters) after the tests run.
	harness.Main(m)
	// Main already closed the shared Apache Kafka clusters through the
	// cleanup registry; this is a no-op then and a safety net otherwise.
	harness.CloseSharedApacheKafka()
}

// fullSize reports whether the full-size drills were asked for (make drills).
func fullSize() bool { return os.Getenv("OUTBOX_RELAY_DRILL_SIZE") == "full" }

// sized returns full when OUTBOX_RELAY_DRILL_SIZE=full, else reduced.
func sized(reduced, full int) int {
	if fullSize() {
		return full
	}
	return reduced
}
