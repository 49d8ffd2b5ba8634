package store

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
)

// Limits of what Put stores of a content PostgreSQL refused as it was.
const (
	// jsonbMax is the most a jsonb value (or one string in it) holds.
	jsonbMax = 1<<28 - 1
	// payloadAsString bounds the payload Put keeps as a JSON string of
	// its text beside raw; a larger one is only in raw.
	payloadAsString = 1 << 20
	// rawMax bounds raw: a bytea holds at most 1 GB, and a statement's
	// message must fit in the same; a larger content is kept by
	// reference (size and digest).
	rawMax = 512 << 20
)

// dataException reports whether PostgreSQL refused a value itself (SQLSTATE
// class 22, data exception, such as U+0000 in text or jsonb; or class 54,
// a value over a limit, such as a jsonb string over 256 MB), rather than
// the statement or the session.
func dataException(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "54"))
}

// WriteAdvice says what to do about an error writing to the quarantine
// table, by its SQLSTATE: only a missing privilege is about grants.
func WriteAdvice(err error) string {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return "check that PostgreSQL is up and reachable from the relay, then start it again"
	}
	switch {
	case pgErr.Code == "42501": // insufficient_privilege
		return "grant the relay's role SELECT, INSERT and UPDATE on it"
	case pgErr.Code == "42703", pgErr.Code == "42P01", pgErr.Code == "42804": // undefined column or table, datatype mismatch
		return "its columns do not match what the relay writes: run `outbox-relay migrate` as the table's owner, and compare the table with `outbox-relay migrate --print-sql`"
	case dataException(err):
		return "PostgreSQL refused a value even with the content kept in raw; this is a bug of the relay: report it with this message"
	case strings.HasPrefix(pgErr.Code, "08"), strings.HasPrefix(pgErr.Code, "57"):
		return "PostgreSQL closed the connection or is shutting down: start the relay again once it is up"
	}
	return "see PostgreSQL's log for the statement's error (SQLSTATE " + pgErr.Code + ")"
}

// textSafe is s as a text column takes it: the relay's own messages may
// quote an event's values, and must not be what fails the write.
func textSafe(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", `\x00`)
}

// pgText reports whether a text column takes s as it is.
func pgText(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

// pgJSON reports whether jsonb takes the JSON text s as it is, for JSON
// that is valid: PostgreSQL refuses invalid UTF-8, the escape \u0000, a
// lone surrogate escape, and anything over jsonbMax.
func pgJSON(s string) bool {
	if len(s) > jsonbMax || !utf8.ValidString(s) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' || i+1 == len(s) {
			continue
		}
		if s[i+1] != 'u' || i+6 > len(s) {
			i++ // an escape of two characters: skip the second
			continue
		}
		r, err := strconv.ParseUint(s[i+2:i+6], 16, 16)
		if err != nil {
			return false
		}
		switch {
		case r == 0:
			return false
		case r >= 0xD800 && r <= 0xDBFF:
			if i+12 > len(s) || s[i+6] != '\\' || s[i+7] != 'u' {
				return false
			}
			low, err := strconv.ParseUint(s[i+8:i+12], 16, 16)
			if err != nil || low < 0xDC00 || low > 0xDFFF {
				return false
			}
			i += 11
			continue
		case r >= 0xDC00 && r <= 0xDFFF:
			return false
		}
		i += 5
	}
	return true
}

// digest is a content's size and SHA-256.
func digest(b []byte) (int64, []byte) {
	sum := sha256.Sum256(b)
	return int64(len(b)), sum[:]
}

// storable is e as the quarantine table takes it after PostgreSQL refused
// it (refused): each text value PostgreSQL cannot take as text is stored
// Go-quoted (strconv.Unquote gives it back); a payload jsonb cannot take
// is stored as a JSON string of its text, or left out when large; headers
// jsonb cannot take are left out; raw keeps the original, which is the
// content as it arrived (raw) or, without one, the event's fields as JSON;
// over rawMax only its size and digest are kept. content_problem and
// error_message say what was changed, so nothing changes silently. whole
// leaves out the payload and the headers, for when the first fallback was
// refused too. ok is false when nothing here explains the refusal.
//
// Escapes and placeholders, not a second table or a rejected write: the
// row must be stored whatever a writer emitted, or the stream stops on it
// (and every relay of the database with it, for logical decoding
// messages), and the typed columns stay what `quarantine list` shows and
// what an operator fixes before a replay.
func (q *Quarantine) storable(e Quarantined, raw []byte, refused error, whole bool) (Quarantined, bool) {
	if raw == nil && e.RawSize == 0 {
		raw, _ = json.Marshal(e.Stored) // the fields PostgreSQL gave the relay: valid UTF-8
	}
	f := e
	var changed []string
	for _, field := range []struct {
		name  string
		value *string
	}{{"aggregate_type", &f.AggregateType}, {"aggregate_id", &f.AggregateID}, {"event_type", &f.EventType}, {"topic", &f.Topic}} {
		if !pgText(*field.value) {
			*field.value = strconv.QuoteToASCII(*field.value)
			changed = append(changed, field.name+" (Go-quoted)")
		}
	}
	switch {
	case f.PayloadBinary || f.PayloadNull:
	case q.payloadCast == "":
		if !pgText(f.Payload) {
			f.Payload = strconv.QuoteToASCII(f.Payload)
			changed = append(changed, "payload (Go-quoted)")
		}
	case whole || !pgJSON(f.Payload):
		if !whole && len(f.Payload) <= payloadAsString {
			text, _ := json.Marshal(strings.ToValidUTF8(f.Payload, "\uFFFD"))
			f.Payload = string(text)
			changed = append(changed, "payload (as a JSON string of its text)")
		} else {
			f.Payload, f.PayloadNull = "", true
			changed = append(changed, fmt.Sprintf("payload (left out: %d bytes)", len(e.Payload)))
		}
	}
	if f.Headers != "" && (whole || !pgJSON(f.Headers)) {
		f.Headers = ""
		changed = append(changed, "headers (left out)")
	}
	if len(changed) == 0 && !whole {
		return e, false
	}
	kept := "raw holds the original"
	switch {
	case raw == nil:
		kept = "the original was too large to keep: raw_size and raw_sha256 describe it"
	case len(raw) > rawMax:
		f.Raw = nil
		f.RawSize, f.RawSHA256 = digest(raw)
		kept = "the original was too large to keep: raw_size and raw_sha256 describe it"
	default:
		f.Raw = raw
		f.RawSize, f.RawSHA256 = digest(raw)
	}
	if len(changed) == 0 {
		changed = append(changed, "nothing found to change")
	}
	note := textSafe(fmt.Sprintf("PostgreSQL refused the row as it was (%v); stored instead: %s; %s",
		unwrapPg(refused), strings.Join(changed, ", "), kept))
	f.ContentProblem = strings.TrimPrefix(e.ContentProblem+"; "+note, "; ")
	f.ErrorMessage = strings.TrimPrefix(e.ErrorMessage+"; "+note, "; ")
	return f, true
}

// unwrapPg is PostgreSQL's own error without the context Put added.
func unwrapPg(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr
	}
	return err
}
