// Package ops tests what an operator relies on: the systemd unit and the
// sd_notify protocol, the admin endpoint and its metrics, the status
// command, Kafka TLS and SASL, secrets kept out of every output, the
// minimal PostgreSQL role, two instances on one slot, two instances of the
// template unit for two databases, and the deploy/ files (both units,
// example config, alert rules, dashboard).
//
// The tests run the relay binary as a child process against a private
// PostgreSQL cluster (shared by the package, one database and slot per
// test) and kfake. Optional tools: systemd-analyze (Debian package
// systemd) and promtool (Debian package prometheus); without them the
// tests that need them skip loudly, unless OUTBOX_RELAY_REQUIRE_SYSTEMD_ANALYZE=1
// or OUTBOX_RELAY_REQUIRE_PROMTOOL=1 makes that a failure.
package ops

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// cluster is the PostgreSQL cluster the package's tests share. Password
// authentication is on for every role but the postgres superuser, so the
// tests can prove what a role with a password needs and that its password
// never leaks.
var cluster *harness.Postgres

func TestMain(m *testing.M) {
	harness.MainWithPostgres(m, harness.PGOptions{
		PasswordAuth: true,
		Settings:     map[string]string{"wal_sender_timeout": "20s"},
	}, func(pg *harness.Postgres) { cluster = pg })
}
