package replication

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/lsn"
)

// backendMessage frames a body as the server sends it.
func backendMessage(typ byte, body []byte) []byte {
	b := []byte{typ}
	b = binary.BigEndian.AppendUint32(b, uint32(4+len(body)))
	return append(b, body...)
}

// xlogMessage is a CopyData body: XLogData carrying a logical decoding
// message at lsn with prefix and content.
func xlogMessage(lsn uint64, prefix string, content []byte) []byte {
	b := []byte{'w'}
	b = binary.BigEndian.AppendUint64(b, lsn)
	b = binary.BigEndian.AppendUint64(b, lsn+100)
	b = binary.BigEndian.AppendUint64(b, 12345)
	b = append(b, 'M', 1)
	b = binary.BigEndian.AppendUint64(b, lsn)
	b = append(append(b, prefix...), 0)
	b = binary.BigEndian.AppendUint32(b, uint32(len(content)))
	return append(b, content...)
}

// timeoutOnce returns a timeout every other read, as a read deadline does,
// so the filter must keep its place across errors.
type timeoutOnce struct {
	r   io.Reader
	hit bool
}

var errTimeout = errors.New("i/o timeout")

func (t *timeoutOnce) Read(p []byte) (int, error) {
	t.hit = !t.hit
	if t.hit {
		return 0, errTimeout
	}
	return t.r.Read(p)
}

// Issue 40.3: a 150 MB message peaked at 613 MB, because the protocol
// reader holds a whole message and the decoder and record copied it again.
// The filter drops a large message's content as it streams by, keeps its
// size and digest, and passes every other message byte for byte, across
// short reads and read timeouts.
func TestOversizeFilterDropsLargeMessageContent(t *testing.T) {
	big := bytes.Repeat([]byte("0123456789abcdef"), 20000) // 320,000 bytes, over the buffer
	keepalive := backendMessage('d', append([]byte{'k'}, make([]byte, 17)...))
	small := backendMessage('d', xlogMessage(0x100, "outbox", []byte(`{"small":true}`)))
	large := backendMessage('d', xlogMessage(0x200, "outbox", big))
	largeInsert := backendMessage('d', append([]byte{'w'}, append(make([]byte, 24), append([]byte{'I'}, big...)...)...))
	errResp := backendMessage('E', []byte("SERROR\x00C42704\x00Mx\x00\x00"))
	stream := bytes.Join([][]byte{keepalive, small, large, largeInsert, keepalive, errResp}, nil)

	for name, wrap := range map[string]func(io.Reader) io.Reader{
		"whole":     func(r io.Reader) io.Reader { return r },
		"one byte":  iotest.OneByteReader,
		"half":      iotest.HalfReader,
		"timeouts":  func(r io.Reader) io.Reader { return &timeoutOnce{r: iotest.HalfReader(r)} },
		"data+eof":  iotest.DataErrReader,
		"in chunks": func(r io.Reader) io.Reader { return io.MultiReader(io.LimitReader(r, 7), r) },
	} {
		t.Run(name, func(t *testing.T) {
			f := newOversizeFilter(wrap(bytes.NewReader(stream)), 1000)
			fe := pgproto3.NewFrontend(f, io.Discard)
			var got [][]byte
			for len(got) < 6 {
				msg, err := fe.Receive()
				if errors.Is(err, errTimeout) {
					continue
				}
				if err != nil {
					t.Fatalf("message %d: %v", len(got)+1, err)
				}
				switch m := msg.(type) {
				case *pgproto3.CopyData:
					got = append(got, append([]byte(nil), m.Data...))
				case *pgproto3.ErrorResponse:
					got = append(got, []byte("E:"+m.Code))
				default:
					t.Fatalf("unexpected %T", msg)
				}
			}
			want := [][]byte{keepalive[5:], small[5:], xlogMessage(0x200, "outbox", nil), largeInsert[5:], keepalive[5:], []byte("E:42704")}
			for i := range want {
				if !bytes.Equal(got[i], want[i]) {
					t.Errorf("message %d: got %d bytes %.60q, want %d bytes %.60q", i+1, len(got[i]), got[i], len(want[i]), want[i])
				}
			}
			o, ok := f.take(0x200)
			if !ok || o.Size != int64(len(big)) || o.SHA256 != sha256.Sum256(big) {
				t.Errorf("kept %+v (%v), want size %d and the content's digest", o, ok, len(big))
			}
			if _, ok := f.take(0x100); ok {
				t.Error("a small message was taken for a dropped one")
			}
			if _, ok := f.take(0x200); ok {
				t.Error("take did not forget what it returned")
			}
		})
	}
}

// The decoder turns a dropped message into a row to quarantine that names
// the reference, under an ID derived from the WAL position.
func TestOversizedMessageBecomesAQuarantinedReference(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 5000)
	stream := backendMessage('d', xlogMessage(0x16B3748, "outbox", big))
	d := newMessageDecoder("outbox")
	d.oversized = newOversizeFilter(bytes.NewReader(stream), 1000)
	msg, err := pgproto3.NewFrontend(d.oversized, io.Discard).Receive()
	if err != nil {
		t.Fatal(err)
	}
	var m Message
	if err := d.decode(msg.(*pgproto3.CopyData).Data[25:], &m); err != nil {
		t.Fatal(err)
	}
	digest := sha256.Sum256(big)
	if m.Kind != KindRow || !bytes.Contains([]byte(m.Row.Unmapped), []byte("5000 bytes, over --max-message-bytes 1000")) ||
		!bytes.Contains([]byte(m.Row.Unmapped), []byte("0/16B3748")) || !bytes.Contains([]byte(m.Row.Unmapped), []byte(hex.EncodeToString(digest[:]))) {
		t.Fatalf("row %v, problem %q: want one to quarantine naming the size, the limit, the position and the digest", m.Kind, m.Row.Unmapped)
	}
	if m.Row.Dropped == nil || m.Row.Dropped.Size != 5000 || m.Row.Dropped.SHA256 != digest || m.Row.ContentAt != 0x16B3748 || m.Row.Content != nil {
		t.Errorf("row keeps %+v at %s with %d content bytes, want the reference alone", m.Row.Dropped, m.Row.ContentAt, len(m.Row.Content))
	}
	if len(m.Row.Values[0]) != 36 {
		t.Errorf("event id %q, want one derived from the position", m.Row.Values[0])
	}
}

// xlog wraps a pgoutput message in XLogData starting at walStart.
func xlog(walStart uint64, pgoutput []byte) []byte {
	b := []byte{'w'}
	b = binary.BigEndian.AppendUint64(b, walStart)
	b = binary.BigEndian.AppendUint64(b, walStart+100)
	b = binary.BigEndian.AppendUint64(b, 12345)
	return append(b, pgoutput...)
}

// A 200 MB jsonb row peaked at 788 MB in the relay. An insert over the
// bound goes on with its large values dropped ('u', which an insert never
// carries), each one's size and digest kept by the change's position and
// column; the decoder makes the row one to quarantine, naming the column,
// with every small value read as it was.
func TestOversizeFilterDropsLargeInsertValues(t *testing.T) {
	id := "0192f0c1-7a3b-7c4d-8e5f-000000000001"
	payload := `{"s": "` + string(bytes.Repeat([]byte("p"), 40000)) + `"}`
	headers := `{"h": "` + string(bytes.Repeat([]byte("h"), 30000)) + `"}`
	values := []string{id, "order", "o-1", "Placed", "1", payload, headers, "2026-12-03 00:00:00+00", "2026-12-03 00:00:00+00"}
	relation := backendMessage('d', xlog(0x500, relationMsg(16384, "public", "outbox_events", outboxCols...)))
	insert := backendMessage('d', xlog(0x600, insertMsg(16384, values...)))
	small := backendMessage('d', xlog(0x700, insertMsg(16384, id, "order", "o-2", "Placed", "1", `{}`, "\x00null", "\x00null", "\x00null")))
	stream := bytes.Join([][]byte{relation, insert, small}, nil)

	for name, wrap := range map[string]func(io.Reader) io.Reader{
		"whole":    func(r io.Reader) io.Reader { return r },
		"one byte": iotest.OneByteReader,
		"timeouts": func(r io.Reader) io.Reader { return &timeoutOnce{r: iotest.HalfReader(r)} },
	} {
		t.Run(name, func(t *testing.T) {
			d := newDecoder("public", "outbox_events", layout.Relay)
			d.oversized = newOversizeFilter(wrap(bytes.NewReader(stream)), 20000)
			fe := pgproto3.NewFrontend(d.oversized, io.Discard)
			// A row's values alias the read buffer: each is checked
			// before the next message is read.
			var rows []Row
			check := []func(Row){
				func(big Row) {
					if string(big.Values[FieldEventID]) != id || string(big.Values[layout.AggregateID]) != "o-1" || big.Values[layout.Payload] != nil || big.Values[layout.Headers] != nil {
						t.Errorf("row values %q: want the small ones as written and the dropped ones absent", big.Values)
					}
					if !strings.Contains(big.Unmapped, fmt.Sprintf("column payload (%d bytes, sha256 %x)", len(payload), sha256.Sum256([]byte(payload)))) ||
						!strings.Contains(big.Unmapped, fmt.Sprintf("column headers (%d bytes", len(headers))) || !strings.Contains(big.Unmapped, "stays in the outbox table") {
						t.Errorf("problem %q does not name both dropped columns", big.Unmapped)
					}
					if big.Dropped == nil || big.Dropped.Size != int64(len(payload)) || big.Dropped.SHA256 != sha256.Sum256([]byte(payload)) {
						t.Errorf("dropped %+v, want the larger column's size and digest", big.Dropped)
					}
				},
				func(small Row) {
					if small.Unmapped != "" || small.Dropped != nil || string(small.Values[layout.Payload]) != "{}" {
						t.Errorf("the small row after it: %+v", small)
					}
				},
			}
			for len(rows) < 2 {
				msg, err := fe.Receive()
				if errors.Is(err, errTimeout) {
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				data := msg.(*pgproto3.CopyData).Data
				m := Message{WALStart: lsn.LSN(binary.BigEndian.Uint64(data[1:]))}
				if err := d.decode(data[25:], &m); err != nil {
					t.Fatal(err)
				}
				if m.Kind == KindRow {
					check[len(rows)](m.Row)
					rows = append(rows, m.Row)
				}
			}
		})
	}
}

// The read loop asks whether the next message is already read before it
// pauses to gather (Stream.Buffered). Bytes held by the filter count: when
// only pgproto3's buffer counted, the loop paused after every transaction
// with the next ones already read, and at 2,000 events/s the relay fell a
// second behind.
func TestOversizeFilterReportsWhatItHolds(t *testing.T) {
	one := backendMessage('d', xlogMessage(0x100, "outbox", []byte(`{"a":1}`)))
	two := backendMessage('d', xlogMessage(0x200, "outbox", []byte(`{"b":2}`)))
	f := newOversizeFilter(bytes.NewReader(append(one, two...)), 1000)
	fe := pgproto3.NewFrontend(f, io.Discard)
	if _, err := fe.Receive(); err != nil {
		t.Fatal(err)
	}
	if got := fe.ReadBufferLen() + f.buffered(); got != len(two) {
		t.Errorf("after the first message %d bytes are held, want the second message's %d", got, len(two))
	}
	if _, err := fe.Receive(); err != nil {
		t.Fatal(err)
	}
	if got := fe.ReadBufferLen() + f.buffered(); got != 0 {
		t.Errorf("after both messages %d bytes are held, want none", got)
	}
}

// BenchmarkReceive is the protocol reader's cost per message with the
// oversize reader beneath it and without, on a stream of single-row
// transactions (Begin, Insert, Commit) as the walsender sends them.
func BenchmarkReceive(b *testing.B) {
	var txn []byte
	txn = append(txn, backendMessage('d', xlog(0x100, wire{}.u8('B').u64(0x200).u64(1).u32(7)))...)
	txn = append(txn, backendMessage('d', xlog(0x100, insertMsg(16384, "0192f0c1-7a3b-7c4d-8e5f-000000000001", "order", "o-1", "Placed", "1",
		`{"amount": 1250, "note": "a payload of about three hundred bytes, as the bench writes"}`, "\x00null", "2026-12-03 00:00:00+00", "2026-12-03 00:00:00+00")))...)
	txn = append(txn, backendMessage('d', xlog(0x100, wire{}.u8('C').u8(0).u64(0x200).u64(0x300).u64(1)))...)
	stream := bytes.Repeat(txn, 1000)
	for _, filtered := range []bool{false, true} {
		b.Run(fmt.Sprintf("filtered=%v", filtered), func(b *testing.B) {
			b.SetBytes(int64(len(stream)))
			for b.Loop() {
				var r io.Reader = bytes.NewReader(stream)
				if filtered {
					r = newOversizeFilter(r, DefaultMaxMessageBytes)
				}
				fe := pgproto3.NewFrontend(r, io.Discard)
				for range 3000 {
					if _, err := fe.Receive(); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
