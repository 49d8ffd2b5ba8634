package tcpdial

import (
	"net"
	"sync"
	"time"
)

// FloorRate is the slowest link a request is given time to cross: a read
// deadline set after a request of n bytes is moved n/FloorRate later. A
// client that bounds each request by one fixed timeout (sarama's
// Net.ReadTimeout) cannot send a record that takes longer than that to
// upload: it times out, sends it again, and loops for as long as the link
// stays slow, the link saturated by its own retries.
const FloorRate = 16 << 10 // bytes per second

// Paced dials like Dialer and gives each request time to cross the link by
// its size: after Write sent n bytes, the next read deadline set in the
// future is moved n/FloorRate later. Small requests keep their timeout, so
// a dead peer is still noticed as soon; a connection whose sent data the
// peer never acknowledges is ended by TCP_USER_TIMEOUT whatever its size.
type Paced struct {
	Dialer *net.Dialer
}

// Dial is the shape sarama's Net.Proxy.Dialer takes.
func (p Paced) Dial(network, addr string) (net.Conn, error) {
	c, err := p.Dialer.Dial(network, addr)
	if err != nil {
		return nil, err
	}
	return &pacedConn{Conn: c}, nil
}

type pacedConn struct {
	net.Conn
	mu      sync.Mutex
	written int // bytes sent since the last read deadline was set
	// writeBy is the write deadline the caller set: a large write is given
	// its crossing time on top of it.
	writeBy time.Time
}

func (c *pacedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	by := c.writeBy
	c.mu.Unlock()
	if len(p) >= FloorRate && by.After(time.Now()) {
		if err := c.Conn.SetWriteDeadline(by.Add(crossing(len(p)))); err != nil {
			return 0, err
		}
	}
	n, err := c.Conn.Write(p)
	c.mu.Lock()
	c.written += n
	c.mu.Unlock()
	return n, err
}

func (c *pacedConn) SetReadDeadline(t time.Time) error {
	return c.Conn.SetReadDeadline(c.paced(t))
}

func (c *pacedConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	c.writeBy = t
	c.mu.Unlock()
	return c.Conn.SetWriteDeadline(t)
}

func (c *pacedConn) SetDeadline(t time.Time) error {
	if err := c.SetWriteDeadline(t); err != nil {
		return err
	}
	return c.Conn.SetReadDeadline(c.paced(t))
}

// crossing is how long n bytes take at FloorRate.
func crossing(n int) time.Duration { return time.Duration(n) * time.Second / FloorRate }

// paced moves a future deadline by the time what was written since the
// last one needs at FloorRate. A zero or past deadline (no deadline, or an
// interruption) is left alone.
func (c *pacedConn) paced(t time.Time) time.Time {
	c.mu.Lock()
	n := c.written
	c.written = 0
	c.mu.Unlock()
	if t.IsZero() || !t.After(time.Now()) || n < FloorRate {
		return t
	}
	return t.Add(crossing(n))
}
