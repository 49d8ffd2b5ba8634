// Package tracing_test follows events end to end through a real tracing
// backend: a service writes each event under a span of its own with
// package outbox, the relay binary publishes it (exporting OTLP to a
// Jaeger all-in-one), and a consumer applies it through package inbox.
// Jaeger's query API must then hold, for each event, one trace with the
// service span, the relay span as its child, and the consumer span as the
// relay span's child. Kafka is read with franz-go, never the relay's own
// client.
//
// Jaeger is built by test/tracing/jaeger/fetch.sh (a module of its own, so
// its dependencies stay out of the main module); without it the tests
// skip, or fail with OUTBOX_RELAY_REQUIRE_JAEGER=1.
package tracing_test

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// cluster is the PostgreSQL cluster the package's tests share; each test
// gets its own database, and so its own slot. Its wal_sender_timeout of a
// minute makes the relay's keepalive status (which confirms what Kafka
// acknowledged) come every 10 s, so the crash drill's relay has that long
// to publish part of the stream without confirming it, on a busy machine.
var cluster *harness.Postgres

func TestMain(m *testing.M) {
	harness.MainWithPostgres(m, harness.PGOptions{Settings: map[string]string{"wal_sender_timeout": "60s"}},
		func(pg *harness.Postgres) { cluster = pg })
}
