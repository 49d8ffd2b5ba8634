package relay

import (
	"context"

	awaitpkg "github.com/outbox-relay/outbox-relay/internal/await"
)

// await is await.Do: the session's waits on Kafka end with its context.
func await[T any](ctx context.Context, connect func() (T, error), release func(T)) (T, error) {
	return awaitpkg.Do(ctx, connect, release)
}
