// Package await gives up on a call that may block on Kafka without taking
// a context.
package await

import "context"

// Do runs connect, which may block without taking a context, on its own
// goroutine, and returns its result or, once ctx ends first, ctx's error;
// a result that arrives after that is released. So SIGTERM stops a relay
// whose broker accepts connections and never answers within seconds, not
// after the client's own timeouts.
func Do[T any](ctx context.Context, connect func() (T, error), release func(T)) (T, error) {
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := connect()
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
		go func() {
			if r := <-done; r.err == nil {
				release(r.v)
			}
		}()
		var zero T
		return zero, ctx.Err()
	}
}
