package relay

// BenchmarkDecodeAndBuild measures the relay's own per-event work on the hot
// path: pgoutput decoding (replication.Stream.Receive) and record building
// (the engine's build, i.e. the NOT NULL checks and the sink's Build, here
// publisher.Publisher.Build),
// with allocations. It runs only with -bench:
//
//	go test -run '^$' -bench DecodeAndBuild -benchmem ./relay/
//
// The replication decoder is unexported and the loop's source seam hands
// out messages already decoded, so hand-built pgoutput messages reach the
// decoder the only exported way: a fake walsender on 127.0.0.1 that answers
// the startup and START_REPLICATION handshake and then streams pre-encoded
// XLogData messages. Its writes reuse one buffer and do not allocate, so the
// allocations reported are the reader's. Socket I/O is included in ns/op.
// Publisher.Build needs a publisher, which needs a broker: an in-process
// kfake cluster that sees only the topic lookup done before the timer starts;
// nothing is sent to it.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outbox-relay/outbox-relay/event"
	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
)

// benchColumns are the outbox table's columns in table order, as the
// migration creates them.
var benchColumns = []string{"event_id", "aggregate_type", "aggregate_id", "event_type",
	"schema_version", "payload", "headers", "occurred_at", "created_at"}

const benchRelOID = 16400

func BenchmarkDecodeAndBuild(b *testing.B) {
	payload := benchPayload(300)
	headers := `{"tenant": "t-42", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`
	for _, bc := range []struct {
		name    string
		perTxn  int
		headers string
		decode  bool
	}{
		// The shapes the issue measures: one event per transaction (Begin
		// and Commit decoded per event) and 100 events per transaction.
		{name: "single-row-txns", perTxn: 1, decode: true},
		{name: "100-row-txns", perTxn: 100, decode: true},
		// A row with its own headers column: JSON parsing in Build.
		{name: "single-row-txns-with-headers", perTxn: 1, headers: headers, decode: true},
		// Build alone, from an already decoded row.
		{name: "build-only", perTxn: 1},
	} {
		b.Run(bc.name, func(b *testing.B) {
			pub := benchPublisher(b)
			var stream *replication.Stream
			if bc.decode {
				stream = benchStream(b, benchWAL(bc.perTxn, 200, payload, bc.headers))
			}
			// build is the engine's build step: the NOT NULL checks,
			// then Publisher.Build.
			build := func(ev *event.Event) (sink.Record, error) {
				if perr := sink.CheckRow(ev); perr != nil {
					return nil, perr
				}
				return pub.Build(ev)
			}
			row := benchRow(b, payload, bc.headers)
			var ev event.Event
			var txn lsn.TxnID
			var commitTime time.Time
			// The engine also adds to the tracker and sends; neither
			// belongs to this benchmark.
			event := func(r *replication.Row) { ev = eventOf(r, layout.Relay, txn, commitTime) }
			// The topic lookup happens once per topic, before the timer.
			event(&row)
			if _, err := pub.BuildWait(context.Background(), &ev); err != nil {
				b.Fatal(err)
			}
			var sink sink.Record
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; {
				r := &row
				if stream != nil {
					msg, err := stream.Receive(time.Now().Add(10 * time.Second))
					if err != nil {
						b.Fatal(err)
					}
					switch msg.Kind {
					case replication.KindBegin:
						txn++
						commitTime = msg.CommitTime
						continue
					case replication.KindRow:
						r = &msg.Row
					default:
						continue
					}
				}
				event(r)
				rec, err := build(&ev)
				if err != nil {
					b.Fatal(err)
				}
				sink = rec
				i++
			}
			b.StopTimer()
			if sink == nil || sink.Size() == 0 {
				b.Fatal("no record built")
			}
		})
	}
}

// benchPublisher returns a publisher connected to an in-process kfake
// cluster holding the benchmark's topic.
func benchPublisher(b *testing.B) *publisher.Publisher {
	b.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(6, "bench"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(c.Close)
	cfg := publisher.DefaultConfig()
	cfg.Brokers = c.ListenAddrs()
	cfg.TopicTemplate = "bench"
	pub, err := publisher.New(cfg, zerolog.Nop())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { pub.Close(5 * time.Second) })
	return pub
}

// benchPayload is a JSON object of about n bytes, as jsonb prints it.
func benchPayload(n int) string {
	base := `{"pad": "", "seq": 123456, "amount": 1234.56, "currency": "EUR", "customer": "cust-421"}`
	return strings.Replace(base, `""`, `"`+strings.Repeat("x", max(n-len(base), 0))+`"`, 1)
}

// benchRow is one row decoded by Stream.Receive from the fake walsender,
// its values copied out of the read buffer.
func benchRow(b *testing.B, payload, headers string) replication.Row {
	b.Helper()
	stream := benchStream(b, benchWAL(1, 1, payload, headers))
	for {
		msg, err := stream.Receive(time.Now().Add(10 * time.Second))
		if err != nil {
			b.Fatal(err)
		}
		if msg.Kind == replication.KindRow {
			row := msg.Row
			for i := range row.Values {
				row.Values[i] = bytes.Clone(row.Values[i])
			}
			return row
		}
	}
}

// benchValues are one row's column values in table order, as pgoutput sends
// them in text form; nil is NULL.
func benchValues(i int, payload, headers string) [][]byte {
	var h []byte
	if headers != "" {
		h = []byte(headers)
	}
	return [][]byte{
		[]byte(fmt.Sprintf("%08x-9c1e-4b7a-8f3d-%012x", i, i*7919)),
		[]byte("order"),
		[]byte(fmt.Sprintf("agg-%d", i%10000)),
		[]byte("order.updated"),
		[]byte("1"),
		[]byte(payload),
		h,
		[]byte("2026-11-29 21:03:56.123456+00"),
		[]byte("2026-11-29 21:03:56.123456+00"),
	}
}

// benchWAL encodes txns transactions of perTxn inserts each as a stream of
// replication CopyData messages (Begin, Insert..., Commit), the way a
// walsender running pgoutput protocol version 1 sends them.
func benchWAL(perTxn, txns int, payload, headers string) []byte {
	var out []byte
	lsnPos := uint64(0x1000000)
	ts := uint64(123456789)
	for t := 0; t < txns; t++ {
		start := lsnPos
		lsnPos += uint64(perTxn*500 + 100)
		begin := []byte{'B'}
		begin = binary.BigEndian.AppendUint64(begin, lsnPos)
		begin = binary.BigEndian.AppendUint64(begin, ts)
		begin = binary.BigEndian.AppendUint32(begin, uint32(1000+t))
		out = appendXLogData(out, start, begin)
		for i := 0; i < perTxn; i++ {
			ins := []byte{'I'}
			ins = binary.BigEndian.AppendUint32(ins, benchRelOID)
			ins = append(ins, 'N')
			vals := benchValues(t*perTxn+i, payload, headers)
			ins = binary.BigEndian.AppendUint16(ins, uint16(len(vals)))
			for _, v := range vals {
				if v == nil {
					ins = append(ins, 'n')
					continue
				}
				ins = append(ins, 't')
				ins = binary.BigEndian.AppendUint32(ins, uint32(len(v)))
				ins = append(ins, v...)
			}
			out = appendXLogData(out, start+uint64(i), ins)
		}
		commit := []byte{'C', 0}
		commit = binary.BigEndian.AppendUint64(commit, lsnPos-8)
		commit = binary.BigEndian.AppendUint64(commit, lsnPos)
		commit = binary.BigEndian.AppendUint64(commit, ts)
		out = appendXLogData(out, lsnPos, commit)
	}
	return out
}

// benchRelation is the Relation message describing the outbox table.
func benchRelation() []byte {
	m := []byte{'R'}
	m = binary.BigEndian.AppendUint32(m, benchRelOID)
	m = append(m, "public\x00outbox_events\x00"...)
	m = append(m, 'd')
	m = binary.BigEndian.AppendUint16(m, uint16(len(benchColumns)))
	for _, c := range benchColumns {
		m = append(m, 0)
		m = append(m, c...)
		m = append(m, 0)
		m = binary.BigEndian.AppendUint32(m, 25) // text
		m = binary.BigEndian.AppendUint32(m, 0xffffffff)
	}
	return m
}

// appendXLogData appends one CopyData message carrying an XLogData.
func appendXLogData(dst []byte, walStart uint64, data []byte) []byte {
	body := []byte{'w'}
	body = binary.BigEndian.AppendUint64(body, walStart)
	body = binary.BigEndian.AppendUint64(body, walStart+uint64(len(data)))
	body = binary.BigEndian.AppendUint64(body, 0)
	body = append(body, data...)
	dst = append(dst, 'd')
	dst = binary.BigEndian.AppendUint32(dst, uint32(4+len(body)))
	return append(dst, body...)
}

// benchStream starts a fake walsender that, after the handshake, sends the
// Relation message and then wal over and over until the connection closes,
// and returns a started Stream reading from it.
func benchStream(b *testing.B, wal []byte) *replication.Stream {
	b.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		conn, err := ln.Accept()
		ln.Close()
		if err != nil {
			return
		}
		defer conn.Close()
		if err := fakeWalsender(conn, wal); err != nil && !errors.Is(err, net.ErrClosed) && !isReset(err) {
			b.Logf("fake walsender: %v", err)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg := replication.Config{
		Config: pg.Config{
			DSN:   fmt.Sprintf("postgres://bench@%s/bench?sslmode=disable&gssencmode=disable", ln.Addr()),
			Table: "public.outbox_events",
		},
		Publication: "outbox_relay",
		Slot:        "bench",
	}
	s, err := replication.OpenStream(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := s.Start(ctx, 0); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		s.Close(context.Background())
		wg.Wait()
	})
	return s
}

func isReset(err error) bool {
	return strings.Contains(err.Error(), "reset by peer") || strings.Contains(err.Error(), "broken pipe")
}

// fakeWalsender answers a replication connection's startup and
// START_REPLICATION, then streams.
func fakeWalsender(conn net.Conn, wal []byte) error {
	be := pgproto3.NewBackend(conn, conn)
	if _, err := be.ReceiveStartupMessage(); err != nil {
		return fmt.Errorf("startup: %w", err)
	}
	be.Send(&pgproto3.AuthenticationOk{})
	be.Send(&pgproto3.ParameterStatus{Name: "server_version", Value: "15.0"})
	be.Send(&pgproto3.BackendKeyData{ProcessID: 1, SecretKey: []byte{0, 0, 0, 1}})
	be.Send(&pgproto3.ReadyForQuery{TxStatus: 'I'})
	if err := be.Flush(); err != nil {
		return err
	}
	msg, err := be.Receive()
	if err != nil {
		return fmt.Errorf("receive START_REPLICATION: %w", err)
	}
	if q, ok := msg.(*pgproto3.Query); !ok || !strings.HasPrefix(q.String, "START_REPLICATION") {
		return fmt.Errorf("unexpected %T", msg)
	}
	be.Send(&pgproto3.CopyBothResponse{OverallFormat: 0})
	if err := be.Flush(); err != nil {
		return err
	}
	if _, err := conn.Write(appendXLogData(nil, 0x1000000, benchRelation())); err != nil {
		return err
	}
	for {
		if _, err := conn.Write(wal); err != nil {
			return err
		}
	}
}
