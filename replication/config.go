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
)

// Config names the database objects the relay reads from.
type Config struct {
	DSN         string
	Table       string // schema-qualified, e.g. "public.outbox_events"
	Publication string
	Slot        string
	// SlotFailover creates the slot as a failover slot (PostgreSQL 17+).
	SlotFailover bool
}

var slotName = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// Validate checks the names before any connection is made.
func (c Config) Validate() error {
	if c.DSN == "" {
		return errors.New("--pg-dsn is required: a libpq URL or key=value string for the database that holds the outbox table")
	}
	if _, err := pgconn.ParseConfig(c.DSN); err != nil {
		return fmt.Errorf("--pg-dsn does not parse: %w", errors.New(RedactError(err.Error(), c.DSN)))
	}
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

// SplitTable splits "schema.table" (schema defaults to public).
func SplitTable(t string) (schema, table string, err error) {
	parts := strings.Split(t, ".")
	switch {
	case len(parts) == 1 && parts[0] != "":
		return "public", parts[0], nil
	case len(parts) == 2 && parts[0] != "" && parts[1] != "":
		return parts[0], parts[1], nil
	}
	return "", "", fmt.Errorf("--table %q: want schema.table, e.g. public.outbox_events", t)
}

// Describe says which server a DSN points at without its password or any
// other secret: host, port, user and database only.
func Describe(dsn string) string {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return "(unparseable dsn)"
	}
	return fmt.Sprintf("host=%s port=%d user=%s dbname=%s", cfg.Host, cfg.Port, cfg.User, cfg.Database)
}

var urlPassword = regexp.MustCompile(`(://[^:/@]*:)[^@]*@`)
var kvPassword = regexp.MustCompile(`(password\s*=\s*)('(\\'|[^'])*'|\S+)`)

// Redact removes passwords from a DSN so it can be printed.
func Redact(dsn string) string {
	dsn = urlPassword.ReplaceAllString(dsn, "${1}xxxxx@")
	return kvPassword.ReplaceAllString(dsn, "${1}xxxxx")
}

// RedactError removes the DSN's password from an error text; pgconn's
// parse errors can quote the DSN.
func RedactError(msg, dsn string) string {
	if cfg, err := pgconn.ParseConfig(dsn); err == nil && cfg.Password != "" {
		msg = strings.ReplaceAll(msg, cfg.Password, "xxxxx")
	}
	msg = strings.ReplaceAll(msg, dsn, Redact(dsn))
	return Redact(msg)
}

func quoteIdent(s string) string { return pgx.Identifier{s}.Sanitize() }

func quoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }
