package messages

import "encoding/json"

// members reads the members of a JSON object, in order. The document
// must be valid JSON.
type members struct {
	doc []byte
	i   int
}

// start reports whether the document is a JSON object.
func (m *members) start(doc []byte) bool {
	m.doc = doc
	m.i = skipSpace(doc, 0)
	if m.i == len(doc) || doc[m.i] != '{' {
		return false
	}
	m.i = skipSpace(doc, m.i+1)
	return true
}

// next returns the next member: the key's text (unescaped) and the
// value's JSON text; ok is false after the last.
func (m *members) next() (key, value []byte, ok bool) {
	doc, i := m.doc, m.i
	if i >= len(doc) || doc[i] == '}' {
		return nil, nil, false
	}
	end := stringEnd(doc, i)
	key = doc[i+1 : end-1]
	if containsBackslash(key) {
		var s string
		_ = json.Unmarshal(doc[i:end], &s) // valid JSON: cannot fail
		key = []byte(s)
	}
	i = skipSpace(doc, end)
	i = skipSpace(doc, i+1) // past ':'
	end = valueEnd(doc, i)
	value = doc[i:end]
	i = skipSpace(doc, end)
	if i < len(doc) && doc[i] == ',' {
		i = skipSpace(doc, i+1)
	}
	m.i = i
	return key, value, true
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

func containsBackslash(b []byte) bool {
	for _, c := range b {
		if c == '\\' {
			return true
		}
	}
	return false
}

// stringEnd is the index after the string that starts at b[i].
func stringEnd(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return len(b)
}

// valueEnd is the index after the JSON value that starts at b[i].
func valueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for ; i < len(b); i++ {
			switch b[i] {
			case '"':
				i = stringEnd(b, i) - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
		}
		return len(b)
	}
	for ; i < len(b); i++ {
		switch b[i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return i
		}
	}
	return len(b)
}
