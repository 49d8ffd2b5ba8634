package pg

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/pgname"
)

var slotName = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// ValidateSlotName checks a replication slot name the way PostgreSQL
// does, so a name can never carry SQL into a printed script. It is here,
// not in replication, because a poller checks the slot too: it refuses to
// run while a WAL relay streams from it.
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

// QuoteIdent quotes an identifier for SQL.
func QuoteIdent(s string) string { return pgx.Identifier{s}.Sanitize() }

// QuoteLiteral quotes a string literal for SQL, for the places that take
// no parameters (replication commands, printed scripts).
func QuoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }
