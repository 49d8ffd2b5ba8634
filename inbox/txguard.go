package inbox

import (
	"context"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A handler's SQL that ends the transaction is refused before it is sent:
// ROLLBACK AND CHAIN or COMMIT AND CHAIN (or "ROLLBACK; BEGIN" in one
// string) leave the connection inside a new transaction, which no status
// check after the handler can tell from the inbox's own, and a write the
// handler made after a plain ROLLBACK committed on its own. What goes
// through tx.Conn() directly is not seen here; the status check in run
// catches the plain COMMIT and ROLLBACK there.

func (t *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.refuse(sql) {
		return pgconn.CommandTag{}, ErrHandlerEndedTx
	}
	return t.Tx.Exec(ctx, sql, args...)
}

func (t *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.refuse(sql) {
		return nil, ErrHandlerEndedTx
	}
	return t.Tx.Query(ctx, sql, args...)
}

func (t *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.refuse(sql) {
		return errRow{ErrHandlerEndedTx}
	}
	return t.Tx.QueryRow(ctx, sql, args...)
}

func (t *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	for _, q := range b.QueuedQueries {
		if t.refuse(q.SQL) {
			return errBatch{err: ErrHandlerEndedTx, tx: t}
		}
	}
	return t.Tx.SendBatch(ctx, b)
}

// refuse reports whether sql ends the transaction, and remembers it.
func (t *handlerTx) refuse(sql string) bool {
	if endsTransaction(sql) {
		t.ended = true
		return true
	}
	return false
}

// endsTransaction reports whether any statement of sql begins with a
// keyword that ends (or replaces) the current transaction. It skips
// string literals, quoted identifiers, dollar-quoted bodies and comments,
// so a function body or a value never counts.
func endsTransaction(sql string) bool {
	start := true // at the start of a statement
	for i := 0; i < len(sql); {
		c := sql[i]
		switch {
		case c == ';':
			start = true
			i++
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			for i < len(sql) && sql[i] != '\n' {
				i++
			}
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			end := strings.Index(sql[i+2:], "*/")
			if end < 0 {
				return false
			}
			i += end + 4
		case c == '\'' || c == '"':
			end := strings.IndexByte(sql[i+1:], c)
			if end < 0 {
				return false
			}
			i += end + 2
			start = false
		case c == '$':
			tag := dollarTag(sql[i:])
			if tag == "" {
				i++
				start = false
				continue
			}
			end := strings.Index(sql[i+len(tag):], tag)
			if end < 0 {
				return false
			}
			i += len(tag) + end + len(tag)
			start = false
		default:
			j := i
			for j < len(sql) && (sql[j] >= 'a' && sql[j] <= 'z' || sql[j] >= 'A' && sql[j] <= 'Z' || sql[j] == '_') {
				j++
			}
			if j == i {
				j = i + 1
			}
			if start && endingKeyword(strings.ToUpper(sql[i:j]), sql[j:]) {
				return true
			}
			start = false
			i = j
		}
	}
	return false
}

// endingKeyword says whether a statement beginning with word (rest is
// what follows it) ends the transaction. ROLLBACK TO a savepoint does not.
func endingKeyword(word, rest string) bool {
	switch word {
	case "COMMIT", "END", "ABORT", "BEGIN", "START":
		return true
	case "ROLLBACK":
		next := strings.ToUpper(strings.TrimSpace(rest))
		return !strings.HasPrefix(next, "TO ") && !strings.HasPrefix(next, "TO\t") && !strings.HasPrefix(next, "TO\n")
	case "PREPARE":
		return strings.HasPrefix(strings.ToUpper(strings.TrimSpace(rest)), "TRANSACTION")
	}
	return false
}

// dollarTag returns the $tag$ that s begins with, or "".
func dollarTag(s string) string {
	for j := 1; j < len(s); j++ {
		switch c := s[j]; {
		case c == '$':
			return s[:j+1]
		case c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || j > 1 && c >= '0' && c <= '9':
		default:
			return ""
		}
	}
	return ""
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

type errBatch struct {
	err error
	tx  pgx.Tx
}

func (b errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b errBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b errBatch) QueryRow() pgx.Row                { return errRow{b.err} }
func (b errBatch) Close() error                     { return b.err }
func (b errBatch) Tx() pgx.Tx                       { return b.tx }
