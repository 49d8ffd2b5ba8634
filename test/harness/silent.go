package harness

import (
	"net"
	"sync"
	"testing"
)

// SilentListener accepts TCP connections on 127.0.0.1 and never answers
// or closes them: a broker whose process hangs, or a port that belongs to
// something that waits for the client to speak in another protocol.
type SilentListener struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

// StartSilentListener starts a listener that is closed, with every
// connection it accepted, when the test ends.
func StartSilentListener(t testing.TB) *SilentListener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("silent listener: %v", err)
	}
	s := &SilentListener{ln: ln}
	go s.accept()
	t.Cleanup(s.close)
	return s
}

// Addr is the listener's host:port.
func (s *SilentListener) Addr() string { return s.ln.Addr().String() }

// Accepted is the number of connections accepted so far.
func (s *SilentListener) Accepted() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

func (s *SilentListener) accept() {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		s.mu.Unlock()
	}
}

func (s *SilentListener) close() {
	s.ln.Close()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.conns {
		c.Close()
	}
}
