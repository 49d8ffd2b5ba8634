package pg

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/tcpdial"
)

// ErrPrecondition marks a server or schema state the operator must fix; the
// relay does not retry it.
var ErrPrecondition = errors.New("precondition failed")

// Preconditionf is an ErrPrecondition error whose message says what to fix.
func Preconditionf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrPrecondition, fmt.Sprintf(format, args...))
}

// Dial opens a plain connection with the session settings the relay
// relies on (UTC ISO timestamps), a bounded connect time, a dead peer
// noticed within cfg.DeadAfter (tcpdial), and connection errors that say
// what to fix.
func Dial(ctx context.Context, cfg Config) (*pgx.Conn, error) {
	pc, err := pgx.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("parse --pg-dsn: %s", RedactError(err.Error(), cfg.DSN))
	}
	pinParams(pc.RuntimeParams, false)
	defaultConnectTimeout(&pc.Config)
	pc.DialFunc = tcpdial.Dialer(cfg.DeadAfter, 0).DialContext
	conn, err := pgx.ConnectConfig(ctx, pc)
	if err != nil {
		return nil, connectError(err, cfg.DSN)
	}
	return conn, nil
}

// DialReplication opens a replication=database connection with the same
// settings and errors as Dial, for the replication protocol's commands;
// frontend, when not nil, builds the protocol reader over the connection.
func DialReplication(ctx context.Context, cfg Config, frontend pgconn.BuildFrontendFunc) (*pgconn.PgConn, error) {
	pc, err := pgconn.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("parse --pg-dsn: %s", RedactError(err.Error(), cfg.DSN))
	}
	pinParams(pc.RuntimeParams, true)
	defaultConnectTimeout(pc)
	pc.DialFunc = tcpdial.Dialer(cfg.DeadAfter, 0).DialContext
	// The stream judges the server's silence by bytes arriving, not by
	// whole messages: over a slow link one message can take many reads.
	pc.AfterNetConnect = func(_ context.Context, _ *pgconn.Config, c net.Conn) (net.Conn, error) {
		return tcpdial.Heard(c), nil
	}
	if frontend != nil {
		pc.BuildFrontend = frontend
	}
	conn, err := pgconn.ConnectConfig(ctx, pc)
	if err != nil {
		return nil, connectError(err, cfg.DSN)
	}
	return conn, nil
}

// defaultConnectTimeout bounds a connection attempt when the DSN does not
// (connect_timeout): a server that accepts TCP and never answers would
// otherwise hang the relay instead of sending it into its retry loop.
func defaultConnectTimeout(c *pgconn.Config) {
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 15 * time.Second
	}
}

// pinParams sets the session parameters decoding relies on (timestamps
// come out as ISO text in UTC) and the replication mode.
func pinParams(params map[string]string, replication bool) {
	delete(params, "replication")
	if replication {
		params["replication"] = "database"
	}
	params["timezone"] = "UTC"
	params["datestyle"] = "ISO, YMD"
	if params["application_name"] == "" {
		params["application_name"] = "outbox-relay"
	}
}

// connectError explains the connection failures an operator can meet.
func connectError(err error, dsn string) error {
	where := Describe(dsn)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case strings.Contains(pgErr.Message, "replication"):
			return Preconditionf("connect to %s: %s: grant the role replication rights: ALTER ROLE <role> REPLICATION", where, pgErr.Message)
		case pgErr.Code == "42501":
			return Preconditionf("connect to %s: %s: grant the role the right to connect: GRANT CONNECT ON DATABASE <database> TO <role>", where, pgErr.Message)
		case strings.Contains(pgErr.Message, "pg_hba.conf"):
			return Preconditionf("connect to %s: %s: add a pg_hba.conf line 'host <database> <role> <relay address>/32 scram-sha-256' (logical replication connections match the database name, not the keyword replication) and reload PostgreSQL", where, pgErr.Message)
		case pgErr.Code == "28P01" || pgErr.Code == "28000":
			return Preconditionf("connect to %s: %s: check the user and password in --pg-dsn", where, pgErr.Message)
		case pgErr.Code == "3D000":
			return Preconditionf("connect to %s: %s: check the database name in --pg-dsn", where, pgErr.Message)
		}
	}
	return fmt.Errorf("connect to %s: %s", where, RedactError(err.Error(), dsn))
}

// ServerNoticesDeathSettings are the SET statements that make the server
// notice a client gone without closing its connection within about
// deadAfter, as the client notices the server (tcpdial). Without them the
// server relies on the host's keepalive settings (two hours by default)
// and a session-level advisory lock held by a vanished poller would keep
// its standby waiting that long. They do nothing over a Unix socket.
func ServerNoticesDeathSettings(deadAfter time.Duration) string {
	if deadAfter <= 0 {
		deadAfter = tcpdial.DefaultDeadAfter
	}
	idle := max(deadAfter/3, time.Second)
	interval := max(deadAfter/6, time.Second)
	return fmt.Sprintf("SET tcp_keepalives_idle = %d; SET tcp_keepalives_interval = %d; SET tcp_keepalives_count = 4; SET tcp_user_timeout = %d",
		int(idle.Seconds()), int(interval.Seconds()), deadAfter.Milliseconds())
}
