// Package tcpdial dials TCP so that a peer which vanishes without a FIN or
// an RST (a NAT or load balancer that dropped the connection's state, a
// host that lost power) is noticed within a known bound instead of when
// the kernel gives up after many minutes. Every connection the relay makes
// to PostgreSQL and to Kafka is dialled through it.
package tcpdial

import (
	"context"
	"net"
	"sync/atomic"
	"syscall"
	"time"
)

// DefaultDeadAfter is the bound when none is configured: half of
// PostgreSQL's own wal_receiver_timeout, so the relay gives up on a dead
// link before a standby's walreceiver would.
const DefaultDeadAfter = 30 * time.Second

// Dialer returns a dialer whose connections are closed by the kernel once
// deadAfter passes with data unacknowledged or with keepalive probes
// unanswered (TCP_USER_TIMEOUT on Linux), and which sends the first probe
// after a third of deadAfter of silence. Keepalives alone would take
// idle + count × interval; TCP_USER_TIMEOUT also ends a connection whose
// sent data is never acknowledged, which keepalives never probe.
func Dialer(deadAfter, connectTimeout time.Duration) *net.Dialer {
	if deadAfter <= 0 {
		deadAfter = DefaultDeadAfter
	}
	return &net.Dialer{
		Timeout: connectTimeout,
		KeepAliveConfig: net.KeepAliveConfig{
			Enable:   true,
			Idle:     max(deadAfter/3, time.Second),
			Interval: max(deadAfter/6, time.Second),
			Count:    4,
		},
		Control: func(network, _ string, c syscall.RawConn) error {
			if network != "tcp" && network != "tcp4" && network != "tcp6" {
				return nil
			}
			return setUserTimeout(c, deadAfter)
		},
	}
}

// Heard wraps c so that LastHeard reports when bytes last arrived on it.
// A reader that waits with short deadlines (the replication stream) cannot
// tell a silent peer from a slow one by its own reads alone: a message
// that takes several reads to arrive over a slow link is progress too.
func Heard(c net.Conn) net.Conn {
	h := &heardConn{Conn: c}
	h.at.Store(time.Now().UnixNano())
	return h
}

// LastHeard is when bytes last arrived on a connection wrapped by Heard;
// ok is false for any other connection.
func LastHeard(c net.Conn) (at time.Time, ok bool) {
	h, ok := c.(*heardConn)
	if !ok {
		return time.Time{}, false
	}
	return time.Unix(0, h.at.Load()), true
}

type heardConn struct {
	net.Conn
	at atomic.Int64
}

func (c *heardConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.at.Store(time.Now().UnixNano())
	}
	return n, err
}

// DialContext is the shape pgconn's DialFunc takes.
type DialContext = func(ctx context.Context, network, addr string) (net.Conn, error)
