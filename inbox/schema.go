package inbox

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Tables names the inbox's tables: Prefix + "_processed", "_versions",
// "_parked", "_unparsable" and "_skipped", in Schema.
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
	for _, p := range []string{t.Schema, t.Prefix + "_unparsable"} {
		if len(p) > 63 || strings.ContainsRune(p, 0) {
			return fmt.Errorf("inbox tables %s.%s_*: names must be at most 63 bytes with no NUL byte", t.Schema, t.Prefix)
		}
		// The upgrade step quotes the names inside a DO block's body.
		if strings.Contains(p, upgradeQuote) {
			return fmt.Errorf("inbox tables %s.%s_*: names must not contain %s", t.Schema, t.Prefix, upgradeQuote)
		}
	}
	return nil
}

// upgradeQuote is the dollar quote around the DDL's upgrade step.
const upgradeQuote = "$inbox_upgrade$"

func (t Tables) name(suffix string) string {
	return pgx.Identifier{t.Schema, t.Prefix + "_" + suffix}.Sanitize()
}

func (t Tables) processed() string  { return t.name("processed") }
func (t Tables) versions() string   { return t.name("versions") }
func (t Tables) parked() string     { return t.name("parked") }
func (t Tables) unparsable() string { return t.name("unparsable") }
func (t Tables) skipped() string    { return t.name("skipped") }

// SQL returns the DDL of the inbox's tables, safe to run more than once.
// Apply it with your own migration tool, in the database that holds the
// consumer's side effects: the record of an event and its effect must
// commit in one local transaction.
//
// It also upgrades tables an older version created: the parked table kept
// headers as jsonb, which cannot hold a NUL byte or bytes that are not
// UTF-8, and refused a nil payload; applying SQL again moves the parked
// events' headers to bytea arrays and lets the payload be NULL, in place.
func SQL(t Tables) (string, error) {
	t = t.withDefaults()
	if err := t.validate(); err != nil {
		return "", err
	}
	return strings.NewReplacer(
		"{{processed}}", t.processed(),
		"{{versions}}", t.versions(),
		"{{parked}}", t.parked(),
		"{{unparsable}}", t.unparsable(),
		"{{skipped}}", t.skipped(),
		"{{parked_literal}}", "'"+strings.ReplaceAll(t.parked(), "'", "''")+"'",
		"{{processed_at_idx}}", pgx.Identifier{t.Prefix + "_processed_at_idx"}.Sanitize(),
		"{{versions_id_idx}}", pgx.Identifier{t.Prefix + "_versions_id_idx"}.Sanitize(),
		"{{parked_id_idx}}", pgx.Identifier{t.Prefix + "_parked_id_idx"}.Sanitize(),
		"{{upgrade}}", upgradeQuote,
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

-- Events that arrived before their predecessor, held until it comes, byte
-- for byte: a NULL payload is a record without a value, and header i is
-- header_keys[i] with header_values[i] (a header may hold any bytes, which
-- text and jsonb cannot).
CREATE TABLE IF NOT EXISTS {{parked}} (
    consumer       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    version        bigint      NOT NULL,
    event_id       text        NOT NULL,
    event_type     text        NOT NULL,
    payload        bytea,
    header_keys    bytea[]     NOT NULL,
    header_values  bytea[]     NOT NULL,
    parked_at      timestamptz NOT NULL,
    PRIMARY KEY (consumer, aggregate_type, aggregate_id, version)
);

-- A record without an aggregate type (CloudEvents, Debezium's shape) finds
-- its aggregate's versions and parked events by the id alone. On a large
-- versions table, create these with CREATE INDEX CONCURRENTLY (same names)
-- before applying the rest, so consumers are not held up meanwhile.
CREATE INDEX IF NOT EXISTS {{versions_id_idx}} ON {{versions}} (consumer, aggregate_id);
CREATE INDEX IF NOT EXISTS {{parked_id_idx}} ON {{parked}} (consumer, aggregate_id);

-- Records no event can be read from (no event id in any record format, a
-- version header that is no positive integer, a structured CloudEvent that
-- is no JSON), set aside so their partition goes on: each as it arrived,
-- byte for byte, with where it was and why it could not be read.
CREATE TABLE IF NOT EXISTS {{unparsable}} (
    consumer      text        NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL,
    "offset"      bigint      NOT NULL,
    record_key    bytea,
    record_value  bytea,
    header_keys   bytea[]     NOT NULL,
    header_values bytea[]     NOT NULL,
    error         text        NOT NULL,
    set_aside_at  timestamptz NOT NULL,
    -- What tells a re-delivery (not stored twice) from another record at
    -- the same place, as after a topic was deleted and made again: the
    -- SHA-256 of the key, the value and the headers.
    record_sha256 bytea       NOT NULL,
    PRIMARY KEY (consumer, topic, partition, "offset", record_sha256)
);

-- Versions an operator declared will never come (SkipMissing), so the
-- events parked behind them could be applied.
CREATE TABLE IF NOT EXISTS {{skipped}} (
    consumer       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    version        bigint      NOT NULL,
    reason         text        NOT NULL,
    skipped_at     timestamptz NOT NULL,
    PRIMARY KEY (consumer, aggregate_type, aggregate_id, version)
);

-- Upgrade a parked table that kept headers as jsonb: its rows' headers
-- move to the bytea arrays (jsonb held them as UTF-8 text already), and
-- the payload may be NULL. A table without the jsonb column is left as is.
DO {{upgrade}}
BEGIN
    IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = {{parked_literal}}::regclass
               AND attname = 'headers' AND NOT attisdropped) THEN
        ALTER TABLE {{parked}} ADD COLUMN IF NOT EXISTS header_keys bytea[],
            ADD COLUMN IF NOT EXISTS header_values bytea[];
        UPDATE {{parked}} SET
            header_keys = ARRAY(SELECT convert_to(key, 'UTF8') FROM jsonb_each_text(headers) ORDER BY key),
            header_values = ARRAY(SELECT convert_to(value, 'UTF8') FROM jsonb_each_text(headers) ORDER BY key);
        ALTER TABLE {{parked}} ALTER COLUMN header_keys SET NOT NULL,
            ALTER COLUMN header_values SET NOT NULL,
            ALTER COLUMN payload DROP NOT NULL,
            DROP COLUMN headers;
    END IF;
END
{{upgrade}};
`
