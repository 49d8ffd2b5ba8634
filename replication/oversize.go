package replication

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"io"
	"sync"
)

// Oversized is a logical decoding message whose content was larger than
// the bound (--max-message-bytes): its size and SHA-256, which is all the
// relay keeps of it.
type Oversized struct {
	Size   int64
	SHA256 [sha256.Size]byte
}

// oversizeFilter reads the replication connection beneath pgproto3. A
// CopyData message larger than limit is rewritten as it streams by when it
// carries one of these (XLogData 'w'):
//   - a logical decoding message (pgoutput 'M'): its content is hashed and
//     dropped, the message goes on with no content, and the size and
//     digest are kept by the message's LSN;
//   - an insert (pgoutput 'I'): each column value over keepColumnBytes is
//     hashed and dropped, and goes on as an unchanged-TOAST value ('u'),
//     which an insert never carries otherwise; size and digest are kept by
//     the change's WAL position and the column's number.
//
// pgproto3 reads a whole message into one buffer, and the decoder, the
// record and the quarantine each copied it again: a 150 MB message peaked
// at 613 MB and a 200 MB jsonb row at 788 MB, and PostgreSQL allows 1 GB.
// Every other message passes unchanged, through the same reads as without
// the filter. Every slot receives every message, whatever its prefix, so a
// large message of another application is dropped the same way (the
// decoder skips it by its prefix anyway).
type oversizeFilter struct {
	r     io.Reader
	limit int

	// buf[start:end] is read from r and not yet handed on.
	buf        []byte
	start, end int
	// pass is how many bytes of the current message go on unchanged.
	pass int
	// out is a rewritten message's start, to hand on before anything else.
	out []byte
	// skip is how many content bytes of the current message are still to
	// be hashed and dropped; when it reaches zero, replacement goes out.
	skip        int
	hash        hash.Hash
	replacement []byte
	at          dropKey
	size        int64
	// inserting says a large insert is being rewritten: column is the
	// next column to read of columns, and bodyLeft its body's bytes not
	// read yet.
	inserting       bool
	column, columns int
	bodyLeft        int

	mu       sync.Mutex
	replaced map[dropKey]Oversized
}

// dropKey names what was dropped: a message by its LSN (column -1), or an
// insert's column by the change's WAL position and the column's number.
type dropKey struct {
	at     uint64
	column int
}

// keepColumnBytes is the largest column value of an oversized insert that
// goes on: identifiers and types are far smaller, and what is larger is
// what made the row too large.
const keepColumnBytes = 16 * 1024

// filterBufSize is the filter's read buffer: as large as pgproto3's own
// chunks, and room enough for a large message's start up to its content.
const filterBufSize = 64 * 1024

// messageContentStart is the offset, in a CopyData body, of a logical
// decoding message's prefix: 'w', three int64 (WAL start, WAL end, send
// time), 'M', the flags byte and the message's LSN.
const messageContentStart = 1 + 24 + 1 + 1 + 8

func newOversizeFilter(r io.Reader, limit int) *oversizeFilter {
	return &oversizeFilter{r: r, limit: limit, buf: make([]byte, filterBufSize), replaced: map[dropKey]Oversized{}}
}

// take returns, and forgets, what the filter kept of the message at LSN at.
func (f *oversizeFilter) take(at uint64) (Oversized, bool) {
	return f.takeKey(dropKey{at: at, column: -1})
}

// takeColumn returns, and forgets, what the filter kept of column i of the
// insert whose XLogData started at walStart.
func (f *oversizeFilter) takeColumn(walStart uint64, i int) (Oversized, bool) {
	return f.takeKey(dropKey{at: walStart, column: i})
}

func (f *oversizeFilter) takeKey(k dropKey) (Oversized, bool) {
	if f == nil {
		return Oversized{}, false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	o, ok := f.replaced[k]
	delete(f.replaced, k)
	return o, ok
}

// buffered is how many bytes the filter read and has not handed on: the
// connection has them, whatever pgproto3's own buffer holds.
func (f *oversizeFilter) buffered() int {
	if f == nil {
		return 0
	}
	return f.end - f.start + len(f.out)
}

// Read implements io.Reader for pgproto3.
func (f *oversizeFilter) Read(p []byte) (int, error) {
	for {
		switch {
		case len(f.out) > 0:
			n := copy(p, f.out)
			f.out = f.out[n:]
			return n, nil
		case f.pass > 0:
			if f.start < f.end {
				n := copy(p[:min(len(p), f.pass)], f.buf[f.start:f.end])
				f.start += n
				f.pass -= n
				return n, nil
			}
			// Straight into the caller's buffer: a large ordinary
			// message costs no extra copy.
			n, err := f.r.Read(p[:min(len(p), f.pass)])
			f.pass -= n
			return n, err
		case f.skip > 0:
			if f.start == f.end {
				if err := f.fill(); err != nil {
					return 0, err
				}
			}
			n := min(f.skip, f.end-f.start)
			f.hash.Write(f.buf[f.start : f.start+n])
			f.start += n
			f.skip -= n
			if f.skip == 0 {
				f.keep()
				if !f.inserting {
					f.finish()
				}
			}
		case f.inserting:
			if err := f.insertColumn(); err != nil {
				return 0, err
			}
		default:
			if err := f.next(); err != nil {
				return 0, err
			}
		}
	}
}

// fill reads more into the buffer, moving what is unread to its start.
func (f *oversizeFilter) fill() error {
	if f.start > 0 {
		f.end = copy(f.buf, f.buf[f.start:f.end])
		f.start = 0
	}
	n, err := f.r.Read(f.buf[f.end:])
	f.end += n
	if n > 0 {
		return nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	return err
}

// next reads the next message's header and decides what to do with it.
func (f *oversizeFilter) next() error {
	for f.end-f.start < 5 {
		if err := f.fill(); err != nil {
			return err
		}
	}
	// Every small message whose header is buffered goes on in one pass:
	// a header at a time cost a single-row transaction 90 ns more.
	pass := 0
	for f.end-(f.start+pass) >= 5 {
		header := f.buf[f.start+pass:]
		bodyLen := int(int32(binary.BigEndian.Uint32(header[1:5]))) - 4
		if header[0] == 'd' && bodyLen > f.limit {
			break
		}
		pass += 5 + max(bodyLen, 0)
	}
	if pass > 0 {
		f.pass = pass
		return nil
	}
	bodyLen := int(int32(binary.BigEndian.Uint32(f.buf[f.start+1:f.start+5]))) - 4
	// A large CopyData: read its start, up to the content, to see
	// whether it is a logical decoding message.
	want := 5 + min(bodyLen, len(f.buf)-5)
	for f.end-f.start < want {
		if err := f.fill(); err != nil {
			return err
		}
	}
	body := f.buf[f.start+5 : f.start+want]
	if len(body) >= insertColumnsStart && body[0] == 'w' && body[25] == 'I' && body[30] == 'N' {
		f.beginInsert(body, bodyLen)
		return nil
	}
	contentAt, ok := messageContent(body, bodyLen)
	if !ok {
		// Not a message, or a prefix longer than the buffer: it goes on
		// whole, as it would without the filter.
		f.pass = 5 + bodyLen
		return nil
	}
	f.at = dropKey{at: binary.BigEndian.Uint64(body[1+24+1+1:]), column: -1}
	f.size = int64(bodyLen - contentAt)
	// The replacement: the same XLogData and message header, with a
	// content length of zero and no content.
	r := make([]byte, 0, 5+contentAt)
	r = append(r, 'd')
	r = binary.BigEndian.AppendUint32(r, uint32(4+contentAt))
	r = append(r, body[:contentAt-4]...)
	f.replacement = binary.BigEndian.AppendUint32(r, 0)
	f.hash = sha256.New()
	f.start += 5 + contentAt
	f.skip = bodyLen - contentAt
	if f.skip == 0 {
		f.finish()
	}
	return nil
}

// keep records what is known of the content just dropped.
func (f *oversizeFilter) keep() {
	var o Oversized
	o.Size = f.size
	f.hash.Sum(o.SHA256[:0])
	f.mu.Lock()
	f.replaced[f.at] = o
	f.mu.Unlock()
	f.hash = nil
}

// finish hands on the replacement.
func (f *oversizeFilter) finish() {
	if f.hash != nil {
		f.keep()
	}
	f.out, f.replacement = f.replacement, nil
}

// insertColumnsStart is the offset, in a CopyData body, of an insert's
// first column: 'w' and its three int64, 'I', the relation's OID, 'N' and
// the column count.
const insertColumnsStart = 1 + 24 + 1 + 4 + 1 + 2

// beginInsert starts rewriting a large insert: its header goes into the
// replacement, and its columns are read one by one (insertColumn).
func (f *oversizeFilter) beginInsert(body []byte, bodyLen int) {
	f.at = dropKey{at: binary.BigEndian.Uint64(body[1:])}
	f.inserting, f.column = true, 0
	f.columns = int(binary.BigEndian.Uint16(body[insertColumnsStart-2:]))
	f.bodyLeft = bodyLen - insertColumnsStart
	r := make([]byte, 0, 5+insertColumnsStart+keepColumnBytes)
	r = append(r, 'd', 0, 0, 0, 0) // the length, once known
	f.replacement = append(r, body[:insertColumnsStart]...)
	f.start += 5 + insertColumnsStart
}

// insertColumn reads the next column of a large insert: a small value is
// copied into the replacement, a large one starts being dropped. After the
// last column the replacement goes out.
func (f *oversizeFilter) insertColumn() error {
	if f.column == f.columns {
		if f.bodyLeft != 0 {
			return fmt.Errorf("replication stream: an insert's columns end %d bytes before its message", f.bodyLeft)
		}
		f.inserting = false
		binary.BigEndian.PutUint32(f.replacement[1:], uint32(len(f.replacement)-1))
		f.finish()
		return nil
	}
	if err := f.need(1); err != nil {
		return err
	}
	switch kind := f.buf[f.start]; kind {
	case 't', 'b':
		if err := f.need(5); err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(f.buf[f.start+1:]))
		if n < 0 || 5+n > f.bodyLeft {
			return fmt.Errorf("replication stream: insert column %d: length %d past its message", f.column, n)
		}
		if n <= keepColumnBytes {
			if err := f.need(5 + n); err != nil {
				return err
			}
			f.replacement = append(f.replacement, f.buf[f.start:f.start+5+n]...)
			f.start += 5 + n
			f.bodyLeft -= 5 + n
			break
		}
		f.bodyLeft -= 5 + n
		f.replacement = append(f.replacement, 'u')
		f.start += 5
		f.at.column, f.size, f.skip, f.hash = f.column, int64(n), n, sha256.New()
	default:
		f.replacement = append(f.replacement, kind)
		f.start++
		f.bodyLeft--
	}
	f.column++
	return nil
}

// need reads until n bytes are buffered; n fits the buffer.
func (f *oversizeFilter) need(n int) error {
	for f.end-f.start < n {
		if err := f.fill(); err != nil {
			return err
		}
	}
	return nil
}

// messageContent returns where a logical decoding message's content starts
// in a CopyData body, when body (the start of a body bodyLen long) is one:
// XLogData whose data is pgoutput's 'M' with flags, LSN, the prefix and
// the content's length, the content filling the rest of the body.
func messageContent(body []byte, bodyLen int) (int, bool) {
	if len(body) < messageContentStart+1 || body[0] != 'w' || body[25] != 'M' {
		return 0, false
	}
	for i := messageContentStart; i < len(body); i++ {
		if body[i] != 0 {
			continue
		}
		at := i + 1 + 4
		if at > len(body) {
			return 0, false
		}
		n := int(binary.BigEndian.Uint32(body[i+1:]))
		if at+n != bodyLen {
			return 0, false
		}
		return at, true
	}
	return 0, false
}
