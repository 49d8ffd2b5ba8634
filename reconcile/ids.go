package reconcile

import (
	"bytes"
	"encoding/hex"
	"slices"
	"sync/atomic"
)

// EventID is an event_id as its 16 uuid bytes: a million of them take 16 MB,
// a sixth of what their text forms would as Go strings.
type EventID [16]byte

// ParseEventID reads a uuid in its canonical text form (8-4-4-4-12 hex
// digits, either case). Ids in any other form are not uuids: reconcile
// cannot match them and counts them apart.
func ParseEventID(s []byte) (EventID, bool) {
	var id EventID
	if len(s) != 36 || s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
		return id, false
	}
	var compact [32]byte
	n := 0
	for i, c := range s {
		if i == 8 || i == 13 || i == 18 || i == 23 {
			continue
		}
		compact[n] = c
		n++
	}
	if _, err := hex.Decode(id[:], compact[:]); err != nil {
		return id, false
	}
	return id, true
}

// String is the canonical lower-case text form.
func (id EventID) String() string {
	var b [36]byte
	hex.Encode(b[0:8], id[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], id[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], id[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], id[8:10])
	b[23] = '-'
	hex.Encode(b[24:], id[10:])
	return string(b[:])
}

// MarshalText lets reports encode ids as uuid text.
func (id EventID) MarshalText() ([]byte, error) { return []byte(id.String()), nil }

func compareIDs(a, b EventID) int { return bytes.Compare(a[:], b[:]) }

// rowSet is the event ids of the window's rows, sorted, each with how many
// records carry it. 20 bytes per row; lookups are binary searches, and the
// counts are atomic so every partition reader can mark its records.
type rowSet struct {
	ids    []EventID
	counts []atomic.Uint32
}

// seal sorts the ids gathered with add and makes room for counts. A row
// the table returns twice (a text id column without a key) is kept once.
func (s *rowSet) seal() {
	slices.SortFunc(s.ids, compareIDs)
	s.ids = slices.Compact(s.ids)
	s.ids = slices.Clip(s.ids)
	s.counts = make([]atomic.Uint32, len(s.ids))
}

func (s *rowSet) add(id EventID) { s.ids = append(s.ids, id) }

// mark counts one record of id and reports whether id is a window row.
func (s *rowSet) mark(id EventID) bool {
	i, ok := slices.BinarySearchFunc(s.ids, id, compareIDs)
	if ok {
		s.counts[i].Add(1)
	}
	return ok
}

// sortedIDs is a sorted set of event ids.
type sortedIDs []EventID

func (s sortedIDs) has(id EventID) bool {
	_, ok := slices.BinarySearchFunc(s, id, compareIDs)
	return ok
}

func (s sortedIDs) index(id EventID) (int, bool) {
	return slices.BinarySearchFunc(s, id, compareIDs)
}
