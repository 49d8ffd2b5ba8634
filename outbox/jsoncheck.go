package outbox

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// PostgreSQL's numeric, which jsonb keeps every number in, holds at most
// 131,072 digits before the decimal point and 16,383 after it; a number
// past either aborts the insert, and with it the writer's transaction.
const (
	maxNumericWeight = 131071
	maxNumericScale  = 16383
)

// checkJSON finds, in a valid JSON document, what jsonb would refuse or
// change without a word: a number past numeric's range (refused, aborting
// the transaction), and an object with a member name twice (jsonb keeps
// the last, dropping the other). It says which and where.
func checkJSON(doc []byte) error {
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	// Each open object's member names; nil for an array.
	var objects []map[string]bool
	expectKey := func() bool {
		return len(objects) > 0 && objects[len(objects)-1] != nil && dec.More()
	}
	for {
		wantKey := expectKey()
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("not a JSON document: %w", err)
		}
		switch t := tok.(type) {
		case json.Delim:
			switch t {
			case '{':
				objects = append(objects, map[string]bool{})
			case '[':
				objects = append(objects, nil)
			default:
				objects = objects[:len(objects)-1]
			}
		case string:
			if !wantKey {
				continue
			}
			names := objects[len(objects)-1]
			if names[t] {
				return fmt.Errorf("an object has the member %q twice, and jsonb would keep only the last; send each name once", t)
			}
			names[t] = true
			// The value after the name is read by the next round; a
			// name is only ever followed by its value.
			if err := checkValue(dec, &objects); err != nil {
				return err
			}
		case json.Number:
			if err := checkNumber(string(t)); err != nil {
				return err
			}
		}
	}
}

// checkValue reads the value that follows a member name: a scalar is
// checked here, an object or array is opened for checkJSON's loop.
func checkValue(dec *json.Decoder, objects *[]map[string]bool) error {
	tok, err := dec.Token()
	if err != nil {
		return fmt.Errorf("not a JSON document: %w", err)
	}
	switch t := tok.(type) {
	case json.Delim:
		if t == '{' {
			*objects = append(*objects, map[string]bool{})
		} else {
			*objects = append(*objects, nil)
		}
	case json.Number:
		return checkNumber(string(t))
	}
	return nil
}

// checkNumber refuses a JSON number numeric cannot hold.
func checkNumber(n string) error {
	mantissa, exp, _ := strings.Cut(strings.ToLower(strings.TrimPrefix(n, "-")), "e")
	e := 0
	if exp != "" {
		v, err := strconv.Atoi(exp)
		if err != nil {
			return fmt.Errorf("the number %.40s has an exponent past numeric's range, which PostgreSQL refuses", n)
		}
		e = v
	}
	whole, frac, _ := strings.Cut(mantissa, ".")
	whole = strings.TrimLeft(whole, "0")
	if strings.Trim(whole+frac, "0") == "" {
		return nil // zero
	}
	weight := len(whole) - 1 + e
	if whole == "" {
		lead := len(frac) - len(strings.TrimLeft(frac, "0"))
		weight = -lead - 1 + e
	}
	scale := len(frac) - e
	if weight > maxNumericWeight || scale > maxNumericScale {
		return fmt.Errorf("the number %.40s is past what PostgreSQL's numeric holds (%d digits before the decimal point, %d after), which jsonb refuses; send it as a string",
			n, maxNumericWeight+1, maxNumericScale)
	}
	return nil
}
