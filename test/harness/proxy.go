package harness

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// Proxy is a TCP proxy on 127.0.0.1 that a test puts between the relay and
// a server (typically PostgreSQL) to cut connections at a chosen moment.
type Proxy struct {
	target string
	ln     net.Listener
	wg     sync.WaitGroup // the accept loop and every connection handler

	mu     sync.Mutex
	paused bool
	closed bool
	conns  map[*proxyConn]struct{}
}

// proxyConn is one client connection and its upstream twin.
type proxyConn struct {
	client, server net.Conn
	once           sync.Once
	finished       chan struct{} // closed when both copy directions ended
}

// cut closes both sides, which ends both copy directions.
func (c *proxyConn) cut() {
	c.once.Do(func() {
		c.client.Close()
		c.server.Close()
	})
}

// StartProxy listens on 127.0.0.1 on a free port and forwards every
// connection to target (host:port). It is closed when the test ends.
func StartProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxy listen: %v", err)
	}
	p := &Proxy{target: target, ln: ln, conns: make(map[*proxyConn]struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the proxy's port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Connections is the number of proxied connections currently open.
func (p *Proxy) Connections() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// CutAll closes every open connection, on both sides, as a network failure
// would, and returns once they are gone. New connections are still
// accepted unless the proxy is paused.
func (p *Proxy) CutAll() {
	p.mu.Lock()
	cut := make([]*proxyConn, 0, len(p.conns))
	for c := range p.conns {
		cut = append(cut, c)
	}
	p.mu.Unlock()
	for _, c := range cut {
		c.cut()
	}
	for _, c := range cut {
		<-c.finished
	}
}

// Pause makes the proxy close new connections right after accepting them,
// so clients see the server as unreachable; open connections are kept
// (combine with CutAll for a full outage). A real refusal would need the
// port released, and another process could grab it meanwhile.
func (p *Proxy) Pause() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.paused = true
}

// Resume undoes Pause.
func (p *Proxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.paused = false
}

// Close stops accepting, cuts every connection and waits for all the
// proxy's goroutines. It is safe to call more than once.
func (p *Proxy) Close() {
	p.mu.Lock()
	already := p.closed
	p.closed = true
	p.mu.Unlock()
	if !already {
		p.ln.Close()
	}
	p.CutAll()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		conn, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // e.g. EMFILE; the listener itself is fine
		}
		p.mu.Lock()
		refuse := p.paused || p.closed
		p.mu.Unlock()
		if refuse {
			conn.Close()
			continue
		}
		// Add here, not in handle: the accept loop still holds its own
		// count, so Close's Wait cannot have passed zero yet.
		p.wg.Add(1)
		go p.handle(conn)
	}
}

func (p *Proxy) handle(client net.Conn) {
	defer p.wg.Done()
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		client.Close()
		return
	}
	c := &proxyConn{client: client, server: server, finished: make(chan struct{})}
	p.mu.Lock()
	if p.paused || p.closed {
		p.mu.Unlock()
		c.cut()
		return
	}
	p.conns[c] = struct{}{}
	p.mu.Unlock()

	// Either direction ending ends the pair: the protocols proxied here
	// never half-close, and a lingering half would hide a cut.
	upDone := make(chan struct{})
	go func() {
		defer close(upDone)
		_, _ = io.Copy(server, client)
		c.cut()
	}()
	_, _ = io.Copy(client, server)
	c.cut()
	<-upDone

	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	close(c.finished)
}
