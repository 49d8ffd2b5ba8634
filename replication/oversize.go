package replication

import (
	"crypto/sha256"
	"encoding/binary"
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
// CopyData message that carries a logical decoding message (XLogData 'w',
// pgoutput 'M') with a body larger than limit is rewritten as it streams
// by: its content is hashed and dropped, the message goes on with no
// content, and the size and digest are kept by the message's LSN for the
// decoder. pgproto3 reads a whole message into one buffer, and the
// decoder, the record and the quarantine each copied it again: a 150 MB
// message peaked at 613 MB, and PostgreSQL allows 1 GB. Every other
// message passes unchanged, through the same reads as without the filter.
//
// Every slot receives every message, whatever its prefix, so a large
// message of another application is dropped the same way (the decoder
// skips it by its prefix anyway).
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
	at          uint64
	size        int64

	mu       sync.Mutex
	replaced map[uint64]Oversized
}

// filterBufSize is the filter's read buffer: as large as pgproto3's own
// chunks, and room enough for a large message's start up to its content.
const filterBufSize = 64 * 1024

// messageContentStart is the offset, in a CopyData body, of a logical
// decoding message's prefix: 'w', three int64 (WAL start, WAL end, send
// time), 'M', the flags byte and the message's LSN.
const messageContentStart = 1 + 24 + 1 + 1 + 8

func newOversizeFilter(r io.Reader, limit int) *oversizeFilter {
	return &oversizeFilter{r: r, limit: limit, buf: make([]byte, filterBufSize), replaced: map[uint64]Oversized{}}
}

// take returns, and forgets, what the filter kept of the message at LSN at.
func (f *oversizeFilter) take(at uint64) (Oversized, bool) {
	if f == nil {
		return Oversized{}, false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	o, ok := f.replaced[at]
	delete(f.replaced, at)
	return o, ok
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
				f.finish()
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
	header := f.buf[f.start:]
	bodyLen := int(int32(binary.BigEndian.Uint32(header[1:5]))) - 4
	if header[0] != 'd' || bodyLen <= f.limit {
		f.pass = 5 + max(bodyLen, 0)
		return nil
	}
	// A large CopyData: read its start, up to the content, to see
	// whether it is a logical decoding message.
	want := 5 + min(bodyLen, len(f.buf)-5)
	for f.end-f.start < want {
		if err := f.fill(); err != nil {
			return err
		}
	}
	body := f.buf[f.start+5 : f.start+want]
	contentAt, ok := messageContent(body, bodyLen)
	if !ok {
		// Not a message, or a prefix longer than the buffer: it goes on
		// whole, as it would without the filter.
		f.pass = 5 + bodyLen
		return nil
	}
	f.at = binary.BigEndian.Uint64(body[1+24+1+1:])
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

// finish keeps what is known of the dropped content and hands on the
// replacement.
func (f *oversizeFilter) finish() {
	var o Oversized
	o.Size = f.size
	f.hash.Sum(o.SHA256[:0])
	f.mu.Lock()
	f.replaced[f.at] = o
	f.mu.Unlock()
	f.out, f.replacement, f.hash = f.replacement, nil, nil
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
