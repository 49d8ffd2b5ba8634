package replication

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/outbox-relay/outbox-relay/internal/tcpdial"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pg"
)

// ErrPublicationGone marks a stream the walsender ended because the
// publication did not exist where the slot decodes. PostgreSQL decodes
// each change with the catalog as it was when the change was written, so
// a publication dropped while the slot still had WAL to read stops that
// slot at the same change on every start, even after it is created again.
// Retrying cannot fix it.
var ErrPublicationGone = errors.New("publication missing in the WAL the slot must decode")

// Stream is one replication connection streaming the slot. It is used from
// one goroutine.
type Stream struct {
	cfg     Config
	conn    *pgconn.PgConn
	decoder *decoder
	msg     Message
	// deadline is the read deadline set on the connection. Setting one
	// per message was a measurable share of the read path.
	deadline time.Time
}

// OpenStream opens a replication=database connection.
func OpenStream(ctx context.Context, cfg Config) (*Stream, error) {
	d, err := cfg.source().newDecoder(cfg)
	if err != nil {
		return nil, err
	}
	var frontend pgconn.BuildFrontendFunc
	if cfg.MaxMessageBytes > 0 {
		frontend = func(r io.Reader, w io.Writer) *pgproto3.Frontend {
			d.oversized = newOversizeFilter(r, cfg.MaxMessageBytes)
			return pgproto3.NewFrontend(d.oversized, w)
		}
	}
	conn, err := pg.DialReplication(ctx, cfg.Config, frontend)
	if err != nil {
		return nil, err
	}
	return &Stream{cfg: cfg, conn: conn, decoder: d}, nil
}

// StartTemporary creates a temporary slot named name on this connection
// and streams from its consistent point: from the changes committed after
// it was made. The server drops the slot when the connection ends, however
// it ends, so nothing is left holding WAL. The configured slot is never
// touched: a dry run uses it while a relay streams the real slot.
func (s *Stream) StartTemporary(ctx context.Context, name string) (lsn.LSN, error) {
	res, err := pglogrepl.CreateReplicationSlot(ctx, s.conn, pg.QuoteIdent(name), "pgoutput",
		pglogrepl.CreateReplicationSlotOptions{Temporary: true, Mode: pglogrepl.LogicalReplication, SnapshotAction: "NOEXPORT_SNAPSHOT"})
	if err != nil {
		return 0, fmt.Errorf("create temporary slot %s: %w (check max_replication_slots and the role's REPLICATION attribute)", name, err)
	}
	at, err := lsn.Parse(res.ConsistentPoint)
	if err != nil {
		return 0, fmt.Errorf("create temporary slot %s: %w", name, err)
	}
	s.cfg.Slot = name
	return at, s.Start(ctx, at)
}

// Start begins streaming the slot from a position, normally the slot's own
// confirmed_flush_lsn. pgoutput protocol version 1 works on PostgreSQL 10
// and later; streaming of in-progress transactions stays off, so the server
// sends each transaction only once it has committed and never an aborted one.
func (s *Stream) Start(ctx context.Context, from lsn.LSN) error {
	args := []string{"proto_version '1'", "publication_names " + pg.QuoteLiteral(pg.QuoteIdent(s.cfg.Publication))}
	args = append(args, s.cfg.source().pluginArgs()...)
	err := pglogrepl.StartReplication(ctx, s.conn, s.cfg.Slot, pglogrepl.LSN(from), pglogrepl.StartReplicationOptions{PluginArgs: args})
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code == "55006":
			return fmt.Errorf("%w: %s", ErrSlotBusy, pgErr.Message)
		case strings.Contains(pgErr.Message, "invalidated") || strings.Contains(pgErr.Message, "can no longer get changes"):
			return fmt.Errorf("%w: slot %q: %s %s: events committed while the relay was behind may never reach Kafka; %s",
				ErrSlotLost, s.cfg.Slot, pgErr.Message, pgErr.Detail, s.cfg.lostSlotAdvice(s.cfg.Slot))
		case pgErr.Code == "42704":
			return pg.Preconditionf("start replication: %s: run `outbox-relay migrate`, or fix --slot", pgErr.Message)
		}
	}
	return fmt.Errorf("start replication on slot %s: %w", s.cfg.Slot, err)
}

// Receive waits until deadline for the next message and decodes it. It
// returns a Message of KindNone when the deadline passes first. The Message
// and its Row are reused by the next call.
func (s *Stream) Receive(deadline time.Time) (*Message, error) {
	// A read deadline instead of a context keeps pgconn from starting a
	// watcher goroutine per message; a timeout leaves the connection usable.
	// Waking earlier than asked is harmless (the caller loops), so the
	// deadline already set stays while it is still ahead and not later.
	if now := time.Now(); !s.deadline.After(now) || s.deadline.After(deadline) {
		if err := s.conn.Conn().SetReadDeadline(deadline); err != nil {
			return nil, fmt.Errorf("set read deadline: %w", err)
		}
		s.deadline = deadline
	}
	raw, err := s.conn.ReceiveMessage(context.Background())
	if err != nil {
		var netErr net.Error
		if errors.As(err, &netErr) && netErr.Timeout() {
			s.msg = Message{Kind: KindNone}
			return &s.msg, nil
		}
		return nil, fmt.Errorf("receive replication message: %w", err)
	}
	switch raw := raw.(type) {
	case *pgproto3.CopyData:
		return s.decodeCopyData(raw.Data)
	case *pgproto3.ErrorResponse:
		if raw.Code == "42704" && strings.HasPrefix(raw.Message, "publication ") {
			return nil, fmt.Errorf("%w: the server stopped the stream of slot %q: %s", ErrPublicationGone, s.cfg.Slot, raw.Message)
		}
		return nil, fmt.Errorf("replication stream: server error %s: %s", raw.Code, raw.Message)
	case *pgproto3.CopyDone:
		return nil, errors.New("replication stream: the server ended the stream")
	default:
		s.msg = Message{Kind: KindOther}
		return &s.msg, nil
	}
}

// Heard is when bytes last arrived from the server: a part of a message
// counts, so a large message crossing a slow link is not silence.
func (s *Stream) Heard() time.Time {
	if at, ok := tcpdial.LastHeard(s.conn.Conn()); ok {
		return at
	}
	// Not dialled by pg.DialReplication: nothing counts its bytes, so
	// it is never taken for silent.
	return time.Now()
}

// Buffered reports whether bytes of the next message were already read
// from the socket, so that Receive would return without waiting.
func (s *Stream) Buffered() bool {
	return s.conn.Frontend().ReadBufferLen() > 0 || s.decoder.oversized.buffered() > 0
}

func (s *Stream) decodeCopyData(data []byte) (*Message, error) {
	m := &s.msg
	if len(data) == 0 {
		return nil, errors.New("replication stream: empty message")
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		if len(data) < 18 {
			return nil, errors.New("replication stream: short keepalive")
		}
		*m = Message{
			Kind:           KindKeepalive,
			ServerWALEnd:   lsn.LSN(binary.BigEndian.Uint64(data[1:])),
			ReplyRequested: data[17] != 0,
		}
		return m, nil
	case pglogrepl.XLogDataByteID:
		if len(data) < 25 {
			return nil, errors.New("replication stream: short xlogdata")
		}
		m.WALStart = lsn.LSN(binary.BigEndian.Uint64(data[1:]))
		m.ServerWALEnd = lsn.LSN(binary.BigEndian.Uint64(data[9:]))
		m.ReplyRequested = false
		if err := s.decoder.decode(data[25:], m); err != nil {
			return nil, fmt.Errorf("decode pgoutput message at %s: %w", m.WALStart, err)
		}
		return m, nil
	}
	s.msg = Message{Kind: KindOther}
	return m, nil
}

// SendStatus reports the relay's positions to the server. flushed is what
// the server may release: it must be a position the relay has confirmed,
// never zero (pglogrepl would replace a zero with written, confirming WAL
// the relay has not), and never past an unacknowledged commit. ping asks
// the server to answer at once with a keepalive, which proves the
// connection alive when nothing else comes.
func (s *Stream) SendStatus(written, flushed lsn.LSN, ping bool) error {
	if flushed == 0 {
		return errors.New("send status update: refusing to send a zero flush position")
	}
	written = max(written, flushed)
	if err := s.conn.Conn().SetWriteDeadline(time.Now().Add(10 * time.Second)); err != nil {
		return fmt.Errorf("send status update: %w", err)
	}
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: pglogrepl.LSN(written),
		WALFlushPosition: pglogrepl.LSN(flushed),
		WALApplyPosition: pglogrepl.LSN(flushed),
		ReplyRequested:   ping,
	})
	if err != nil {
		return fmt.Errorf("send status update: %w", err)
	}
	return nil
}

// Close ends the stream and the connection. While ctx has time left it
// first ends the copy stream the way the protocol asks (CopyDone, then
// reading until the server's ReadyForQuery), so the server has read the
// last status update before the socket closes: closing at once could
// reset the connection with that update unread, and the slot would stay
// behind what was confirmed. With ctx already done it only closes.
func (s *Stream) Close(ctx context.Context) error {
	var err error
	if ctx.Err() == nil {
		err = s.endCopy(ctx)
	}
	if cerr := s.conn.Close(ctx); cerr != nil && err == nil && ctx.Err() == nil {
		err = fmt.Errorf("close replication connection: %w", cerr)
	}
	return err
}

// endCopy sends CopyDone and reads what the server still sends until it
// is ready for a query, within ctx's deadline (5 s without one).
func (s *Stream) endCopy(ctx context.Context) error {
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(5 * time.Second)
	}
	if err := s.conn.Conn().SetDeadline(deadline); err != nil {
		return fmt.Errorf("end replication stream: %w", err)
	}
	if _, err := pglogrepl.SendStandbyCopyDone(ctx, s.conn); err != nil {
		return fmt.Errorf("end replication stream: %w", err)
	}
	return nil
}
