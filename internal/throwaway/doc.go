// Package throwaway starts throwaway local services for the demo and the
// tests: private PostgreSQL clusters (wal_level=logical, on 127.0.0.1, run
// as the postgres OS user when the caller is root, any supported major
// version) with streaming standbys, and in-process Kafka brokers (franz-go's
// kfake).
//
// It never imports testing, so a shipped binary using it (the demo) does not
// link the test framework: every call returns an error, and Services stops
// whatever is still running when the caller is done or gets a signal.
// test/harness wraps it for tests, turning errors into t.Fatal and closes
// into t.Cleanup.
//
// Temporary directories it creates carry an owner marker, so a later
// process can remove what a killed one left behind (ReapOrphans).
package throwaway
