package tcpdial

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The kernel is told the bound: a peer that never acknowledges ends the
// connection after deadAfter, and keepalive probes start at a third of it.
func TestDialerSetsTheKernelsBound(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := Dialer(9*time.Second, time.Second).DialContext(context.Background(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var userTimeout, idle int
	var serr error
	raw.Control(func(fd uintptr) {
		userTimeout, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT)
		if serr == nil {
			idle, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_KEEPIDLE)
		}
	})
	if serr != nil {
		t.Fatal(serr)
	}
	if userTimeout != 9000 || idle != 3 {
		t.Fatalf("TCP_USER_TIMEOUT %d ms, TCP_KEEPIDLE %d s; want 9000 and 3", userTimeout, idle)
	}
}

// Heard moves with every read that brings bytes, and only then.
func TestHeardMovesWithBytes(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	h := Heard(a)
	start, ok := LastHeard(h)
	if !ok {
		t.Fatal("LastHeard does not know a Heard connection")
	}
	if _, ok := LastHeard(a); ok {
		t.Fatal("LastHeard claims a plain connection")
	}
	go b.Write([]byte("x"))
	buf := make([]byte, 1)
	if _, err := h.Read(buf); err != nil {
		t.Fatal(err)
	}
	if at, _ := LastHeard(h); !at.After(start) {
		t.Fatalf("LastHeard %v did not move past %v after a read", at, start)
	}
	h.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	before, _ := LastHeard(h)
	if _, err := h.Read(buf); err == nil {
		t.Fatal("read without data returned no error")
	}
	if at, _ := LastHeard(h); !at.Equal(before) {
		t.Fatal("a read that brought nothing moved LastHeard")
	}
}

// A read deadline set after a large request is moved by the request's
// crossing time at FloorRate; after a small one, or when past, it stays.
func TestPacedDeadlines(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	go io.Copy(io.Discard, b)
	c := &pacedConn{Conn: a}
	if _, err := c.Write(make([]byte, 10*FloorRate)); err != nil {
		t.Fatal(err)
	}
	want := time.Now().Add(time.Second)
	if got := c.paced(want); got.Sub(want) != 10*time.Second {
		t.Fatalf("after %d bytes the read deadline moved by %v, want 10s", 10*FloorRate, got.Sub(want))
	}
	if got := c.paced(want); !got.Equal(want) {
		t.Fatalf("a second deadline with nothing written since moved by %v", got.Sub(want))
	}
	if _, err := c.Write(make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	if got := c.paced(want); !got.Equal(want) {
		t.Fatalf("after a small request the deadline moved by %v", got.Sub(want))
	}
	if _, err := c.Write(make([]byte, 10*FloorRate)); err != nil {
		t.Fatal(err)
	}
	past := time.Unix(1, 0)
	if got := c.paced(past); !got.Equal(past) {
		t.Fatalf("an interrupting deadline in the past moved to %v", got)
	}
}
