// Package replication reads the outbox table's committed inserts from
// PostgreSQL's write-ahead log. It checks the server's preconditions, owns the
// pgoutput logical replication slot and the replication connection, decodes
// pgoutput messages into transactions and rows, and sends the standby status
// updates that tell the server what the relay has confirmed. It knows nothing
// of Kafka.
package replication

import (
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/pgname"
	"github.com/outbox-relay/outbox-relay/layout"
)

// Config names the database objects the relay reads from.
type Config struct {
	DSN         string
	Table       string // schema-qualified, e.g. "public.outbox_events"
	Publication string
	Slot        string
	// SlotFailover creates the slot as a failover slot (PostgreSQL 17+).
	SlotFailover bool
	// Layout is the outbox table's columns and the records' shape; nil
	// is the relay's own.
	Layout *layout.Layout
	// MessagePrefix, when set, makes this the messages source: the events
	// are the transactional logical decoding messages with this prefix,
	// and Table is not read.
	MessagePrefix string
}

// OutboxLayout is the configured layout, the relay's own when none is.
func (c Config) OutboxLayout() *layout.Layout {
	if c.Layout == nil {
		return layout.Relay
	}
	return c.Layout
}

var slotName = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// Validate checks the names before any connection is made.
func (c Config) Validate() error {
	if c.DSN == "" {
		return errors.New("--pg-dsn is required: a libpq URL or key=value string for the database that holds the outbox table")
	}
	if _, err := pgconn.ParseConfig(c.DSN); err != nil {
		return fmt.Errorf("--pg-dsn does not parse: %s (fix the connection string; see libpq's connection string formats)", parseProblem(err))
	}
	return c.ValidateNames()
}

// ValidateNames checks the table, slot and publication names alone, for
// paths that need no connection, such as printing the migration SQL.
func (c Config) ValidateNames() error {
	if _, _, err := SplitTable(c.Table); err != nil {
		return err
	}
	if err := ValidateSlotName(c.Slot); err != nil {
		return err
	}
	return ValidateIdentifier("--publication", c.Publication)
}

// ValidateSlotName checks a slot name the way PostgreSQL does, so a name
// can never carry SQL into a printed script.
func ValidateSlotName(name string) error {
	if !slotName.MatchString(name) {
		return fmt.Errorf("--slot %q: slot names are 1 to 63 lower-case letters, digits or underscores", name)
	}
	return nil
}

// ValidateIdentifier checks a name that is quoted into SQL: 1 to 63 bytes
// (PostgreSQL would silently truncate a longer one) and no NUL byte, which
// no identifier can hold.
func ValidateIdentifier(flag, name string) error {
	if name == "" || len(name) > 63 || strings.ContainsRune(name, 0) {
		return fmt.Errorf("%s %q: must be 1 to 63 bytes with no NUL byte", flag, name)
	}
	return nil
}

// SplitTable splits the --table value "schema.table" (schema defaults to
// public).
func SplitTable(t string) (schema, table string, err error) {
	return SplitTableFlag("--table", t)
}

// SplitTableFlag is SplitTable for a value that came from another flag, so
// the error names the flag the operator has to fix.
//
// The value follows PostgreSQL's quoting rules: a part in double quotes is
// taken as written, may hold dots, and writes a double quote as two, so
// "S"."a.b" names table a.b in schema S. An unquoted part is taken as
// written too, case and any quote inside it included: the relay always quotes the names it is given,
// and folding them would point an existing --table MyTable at another table.
func SplitTableFlag(flagName, t string) (schema, table string, err error) {
	parts, ok := pgname.Split(t)
	switch {
	case !ok:
	case len(parts) == 1:
		return "public", parts[0], nil
	case len(parts) == 2:
		return parts[0], parts[1], nil
	}
	return "", "", fmt.Errorf("%s %q: want schema.table, e.g. public.outbox_events, with a part in double quotes when it holds a dot (\"S\".\"a.b\")", flagName, t)
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

func quoteIdent(s string) string { return pgx.Identifier{s}.Sanitize() }

func quoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }
