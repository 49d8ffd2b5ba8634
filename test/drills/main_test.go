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
	"testing"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// shared is the PostgreSQL cluster the drills share when they do not need
// server settings of their own; each drill gets its own database, and so
// its own slot.
var shared *harness.Postgres

func TestMain(m *testing.M) {
	// Main stops everything the harness registered (the shared cluster,
	// relay processes, Apache Kafka clusters) after the tests run.
	harness.MainWithPostgres(m, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "20s"}},
		func(pg *harness.Postgres) { shared = pg })
	// Main already closed the shared Apache Kafka clusters through the
	// cleanup registry; this is a no-op then and a safety net otherwise.
	harness.CloseSharedApacheKafka()
}
