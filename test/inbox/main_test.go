// Package inboxdrills holds the consumer library's drills: package inbox
// and its adapters (inboxsarama, inboxkgo) against a private PostgreSQL
// and Apache Kafka, with writers producing at a steady rate throughout,
// and every result checked from the consumer's database and Kafka's
// committed offsets, never from the adapters' own account.
package inboxdrills

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// pg is the PostgreSQL cluster the drills share; each takes a database of
// its own.
var pg *harness.Postgres

func TestMain(m *testing.M) {
	harness.MainWithPostgres(m, harness.PGOptions{}, func(p *harness.Postgres) { pg = p })
	harness.CloseSharedApacheKafka()
}
