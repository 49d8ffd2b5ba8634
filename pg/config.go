// Package pg connects to PostgreSQL: the connection settings every part of
// the relay shares (the DSN, the outbox table and its layout), connections
// with the session settings the relay relies on and errors that say what
// to fix, the checks of names and privileges, and the check that keeps a
// WAL relay and a poller off one table at once. Both sources, the
// quarantine table, migrations and reconcile connect through it; what only
// streaming from a slot needs stays in replication.
package pg

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/layout"
)

// Config is the database and the outbox table in it.
type Config struct {
	DSN   string
	Table string // schema-qualified, e.g. "public.outbox_events"
	// Layout is the outbox table's columns and the records' shape; nil
	// is the relay's own.
	Layout *layout.Layout
	// DeadAfter is how long a connection may go with what it sent
	// unacknowledged, or a replication stream with nothing from the
	// server, before it is taken for dead and made again (--pg-timeout);
	// zero is tcpdial.DefaultDeadAfter.
	DeadAfter time.Duration
}

// OutboxLayout is the configured layout, the relay's own when none is.
func (c Config) OutboxLayout() *layout.Layout {
	if c.Layout == nil {
		return layout.Relay
	}
	return c.Layout
}

// Validate checks the DSN and the table name before any connection is
// made.
func (c Config) Validate() error {
	if c.DSN == "" {
		return errors.New("--pg-dsn is required: a libpq URL or key=value string for the database that holds the outbox table")
	}
	if _, err := pgconn.ParseConfig(c.DSN); err != nil {
		return fmt.Errorf("--pg-dsn does not parse: %s (fix the connection string; see libpq's connection string formats)", parseProblem(err))
	}
	_, _, err := SplitTable(c.Table)
	return err
}

// QuotedTable is Table as a quoted, schema-qualified name.
func (c Config) QuotedTable() (string, error) {
	schema, table, err := SplitTable(c.Table)
	if err != nil {
		return "", err
	}
	return QuoteIdent(schema) + "." + QuoteIdent(table), nil
}

// unparseable stands in for a connection string that does not parse: such a
// string has no reliable field boundaries, so no part of it is shown.
const unparseable = "(a connection string that does not parse)"

// Describe says which server a DSN points at, built from the parsed fields
// (host, port, user and database) so no secret can be part of it.
func Describe(dsn string) string {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return unparseable
	}
	return fmt.Sprintf("host=%s port=%d user=%s dbname=%s", cfg.Host, cfg.Port, cfg.User, cfg.Database)
}

// parseProblem is why pgconn refused a connection string, without the
// string: pgconn quotes it with a best-effort mask that can miss a password
// in malformed input.
func parseProblem(err error) string {
	var pe *pgconn.ParseConfigError
	if !errors.As(err, &pe) {
		return "invalid connection string"
	}
	bare := *pe
	bare.ConnString = ""
	return strings.TrimPrefix(bare.Error(), "cannot parse ``: ")
}

var (
	// quotedConnString is pgconn's parse error quoting the connection
	// string; the text up to the last "`: " is the quote.
	quotedConnString = regexp.MustCompile("cannot parse `.*`: ")
	// URL user info and key=value passwords are masked by their syntax, a
	// safety net for a DSN quoted in a form other than the one configured.
	urlPassword = regexp.MustCompile(`(://[^:/@\s]*:)[^@\s]*@`)
	kvPassword  = regexp.MustCompile(`(\bpassword\s*=\s*)('(\\'|[^'])*'|\S+)`)
)

// RedactError makes an error text fit to print. The DSN, where quoted, is
// replaced by Describe's form, a DSN pgconn could not parse is dropped, and
// anything still shaped like a password field is masked. The password's
// value is never searched for: that garbles words that happen to contain it
// and so gives it away.
func RedactError(msg, dsn string) string {
	if dsn != "" {
		msg = strings.ReplaceAll(msg, dsn, Describe(dsn))
	}
	msg = quotedConnString.ReplaceAllLiteralString(msg, "cannot parse "+unparseable+": ")
	msg = urlPassword.ReplaceAllString(msg, "${1}xxxxx@")
	return kvPassword.ReplaceAllString(msg, "${1}xxxxx")
}
