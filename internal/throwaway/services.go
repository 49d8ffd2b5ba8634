package throwaway

import (
	"sort"
	"sync"
)

// Services is what one process started that must not outlive it: it holds
// the teardown of every cluster (registered before the cluster's first
// program runs, so a signal half-way through a start still reaches it) and
// of anything else a caller adds with OnClose, and it caches the copy of a
// fetched PostgreSQL installation. The zero value is ready to use; keep one
// per process and call Close when done and on SIGINT/SIGTERM.
type Services struct {
	mu   sync.Mutex
	next int
	fns  map[int]func()

	pgInstall struct {
		once sync.Once
		bin  string
		err  error
	}
}

// OnClose adds fn to what Close runs; the returned func removes it again
// once its owner has cleaned up itself.
func (s *Services) OnClose(fn func()) (remove func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fns == nil {
		s.fns = make(map[int]func())
	}
	id := s.next
	s.next++
	s.fns[id] = fn
	return func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		delete(s.fns, id)
	}
}

// Close runs every function added so far, newest first, like t.Cleanup:
// later resources may depend on earlier ones (a relay on its database). It
// may be called more than once; functions added after a Close wait for the
// next one.
func (s *Services) Close() {
	s.mu.Lock()
	ids := make([]int, 0, len(s.fns))
	for id := range s.fns {
		ids = append(ids, id)
	}
	fns := s.fns
	s.fns = nil
	s.mu.Unlock()
	// The functions run without the lock held, because they usually
	// remove themselves.
	sort.Sort(sort.Reverse(sort.IntSlice(ids)))
	for _, id := range ids {
		fns[id]()
	}
}
