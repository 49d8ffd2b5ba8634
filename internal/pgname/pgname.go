// Package pgname parses the dotted, optionally quoted table names that
// flags and the writer library take.
package pgname

import "strings"

// Split splits a dotted name into its parts by PostgreSQL's quoting rules:
// a part in double quotes is taken as written, may hold dots, and writes a
// double quote as two. An unquoted part is taken as written too (no case
// folding), any quote after its first character included. False when a
// part is empty, a quote is left open, or text follows a closing quote.
func Split(s string) ([]string, bool) {
	var parts []string
	for {
		var part strings.Builder
		if strings.HasPrefix(s, `"`) {
			s = s[1:]
			for {
				i := strings.IndexByte(s, '"')
				if i < 0 {
					return nil, false
				}
				part.WriteString(s[:i])
				s = s[i+1:]
				if !strings.HasPrefix(s, `"`) {
					break
				}
				part.WriteByte('"') // "" inside quotes is one quote
				s = s[1:]
			}
			if s != "" && s[0] != '.' {
				return nil, false // text after the closing quote
			}
		} else {
			i := strings.IndexByte(s, '.')
			if i < 0 {
				i = len(s)
			}
			// A quote inside an unquoted part is kept as written, as
			// before quoting was understood: only a leading one quotes.
			part.WriteString(s[:i])
			s = s[i:]
		}
		if part.Len() == 0 {
			return nil, false
		}
		parts = append(parts, part.String())
		if s == "" {
			return parts, true
		}
		s = s[1:] // the dot
		if s == "" {
			return nil, false
		}
	}
}
