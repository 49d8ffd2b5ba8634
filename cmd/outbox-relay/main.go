// Command outbox-relay streams committed outbox rows from a PostgreSQL
// logical replication slot to Kafka. See the README for usage.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/rs/zerolog"
)

func main() {
	logDurationsWithUnits()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// logDurationsWithUnits makes every duration field read like "1s" or
// "349.2ms" instead of a bare number of milliseconds, which operators took
// for seconds. zerolog only offers this process-wide, so main sets it once
// before anything logs.
func logDurationsWithUnits() {
	zerolog.DurationFieldFormat = zerolog.DurationFormatString
}
