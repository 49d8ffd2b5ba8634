package event

import (
	"encoding/hex"
	"errors"
	"fmt"
)

// A bytea payload travels as PostgreSQL's text form of it: pgoutput sends
// every column as text, and the SQL readers read the same text, so the
// sources need not know the column's type. Build decodes it once, into the
// record's buffer, which it copies into anyway: no allocation of its own.
// The quarantine table keeps the text form too, so a replay decodes the
// same bytes.

// errBytea is the error of a bytea text form that does not parse, which
// PostgreSQL never sends.
var errBytea = errors.New("payload is not bytea's text form")

// appendBytea appends the bytes of bytea's text form: the hex format
// (`\x` and two hex digits a byte), or the escape format an older
// bytea_output gives (printable bytes as they are, `\\` for a backslash,
// `\ooo` in octal for the others).
func appendBytea(dst, text []byte) ([]byte, error) {
	if len(text) >= 2 && text[0] == '\\' && text[1] == 'x' {
		out, err := hex.AppendDecode(dst, text[2:])
		if err != nil {
			// Not wrapped: hex's error quotes the payload's byte, and
			// errors reach the log.
			return dst, fmt.Errorf("%w: not two hex digits a byte after \\x", errBytea)
		}
		return out, nil
	}
	for i := 0; i < len(text); i++ {
		c := text[i]
		if c != '\\' {
			dst = append(dst, c)
			continue
		}
		switch {
		case i+1 < len(text) && text[i+1] == '\\':
			dst = append(dst, '\\')
			i++
		case i+3 < len(text) && octal(text[i+1]) && text[i+1] <= '3' && octal(text[i+2]) && octal(text[i+3]):
			dst = append(dst, (text[i+1]-'0')<<6|(text[i+2]-'0')<<3|(text[i+3]-'0'))
			i += 3
		default:
			return dst, fmt.Errorf("%w: stray backslash at offset %d", errBytea, i)
		}
	}
	return dst, nil
}

func octal(c byte) bool { return '0' <= c && c <= '7' }

// byteaText is bytes in bytea's hex text form, as the quarantine table
// keeps a binary payload.
func byteaText(b []byte) string {
	out := make([]byte, 2, 2+2*len(b))
	out[0], out[1] = '\\', 'x'
	return string(hex.AppendEncode(out, b))
}

// takeBytea copies the bytes of bytea's text form into the arena.
func (a *arena) takeBytea(text []byte) ([]byte, error) {
	start := len(a.buf)
	b, err := appendBytea(a.buf, text)
	if err != nil {
		return nil, err
	}
	a.buf = b
	return a.buf[start:len(a.buf):len(a.buf)], nil
}

// PayloadBytes is the bytes of a binary payload, which Payload holds in
// bytea's text form; the quarantine table keeps them as bytes.
func (s *Stored) PayloadBytes() ([]byte, error) {
	return appendBytea(nil, []byte(s.Payload))
}
