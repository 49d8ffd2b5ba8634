package inbox

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Tables names the inbox's tables: Prefix + "_processed", "_versions" and
// "_parked", in Schema.
type Tables struct {
	Schema string // default public
	Prefix string // default inbox
}

func (t Tables) withDefaults() Tables {
	if t.Schema == "" {
		t.Schema = "public"
	}
	if t.Prefix == "" {
		t.Prefix = "inbox"
	}
	return t
}

func (t Tables) validate() error {
	for _, p := range []string{t.Schema, t.Prefix + "_processed"} {
		if len(p) > 63 || strings.ContainsRune(p, 0) {
			return fmt.Errorf("inbox tables %s.%s_*: names must be at most 63 bytes with no NUL byte", t.Schema, t.Prefix)
		}
	}
	return nil
}

func (t Tables) name(suffix string) string {
	return pgx.Identifier{t.Schema, t.Prefix + "_" + suffix}.Sanitize()
}

func (t Tables) processed() string { return t.name("processed") }
func (t Tables) versions() string  { return t.name("versions") }
func (t Tables) parked() string    { return t.name("parked") }

// SQL returns the DDL of the inbox's tables, safe to run more than once.
// Apply it with your own migration tool, in the database that holds the
// consumer's side effects: the record of an event and its effect must
// commit in one local transaction.
func SQL(t Tables) (string, error) {
	t = t.withDefaults()
	if err := t.validate(); err != nil {
		return "", err
	}
	return strings.NewReplacer(
		"{{processed}}", t.processed(),
		"{{versions}}", t.versions(),
		"{{parked}}", t.parked(),
		"{{processed_at_idx}}", pgx.Identifier{t.Prefix + "_processed_at_idx"}.Sanitize(),
	).Replace(ddl), nil
}

const ddl = `-- One row per event a consumer applied (or skipped as an old version).
-- The primary key turns a re-delivered event into a no-op.
CREATE TABLE IF NOT EXISTS {{processed}} (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
-- Retention deletes by age.
CREATE INDEX IF NOT EXISTS {{processed_at_idx}} ON {{processed}} (processed_at);

-- The last version applied per aggregate, for consumers that check order.
CREATE TABLE IF NOT EXISTS {{versions}} (
    consumer       text   NOT NULL,
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    version        bigint NOT NULL,
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);

-- Events that arrived before their predecessor, held until it comes.
CREATE TABLE IF NOT EXISTS {{parked}} (
    consumer       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    version        bigint      NOT NULL,
    event_id       text        NOT NULL,
    event_type     text        NOT NULL,
    payload        bytea       NOT NULL,
    headers        jsonb       NOT NULL,
    parked_at      timestamptz NOT NULL,
    PRIMARY KEY (consumer, aggregate_type, aggregate_id, version)
);
`
