package inbox

import "testing"

// A handler's SQL that ends the inbox's transaction is refused before it
// is sent; what only looks like it (a savepoint's rollback, a value, a
// function body, a comment) goes through.
func TestEndsTransaction(t *testing.T) {
	for sql, want := range map[string]bool{
		"COMMIT":                                true,
		"commit and chain":                      true,
		"  ROLLBACK AND CHAIN":                  true,
		"rollback; begin":                       true,
		"INSERT INTO t VALUES (1); COMMIT":      true,
		"END":                                   true,
		"abort":                                 true,
		"PREPARE TRANSACTION 'x'":               true,
		"START TRANSACTION":                     true,
		"/* c */ COMMIT":                        true,
		"-- a note\nROLLBACK":                   true,
		"ROLLBACK TO SAVEPOINT s":               false,
		"rollback to s":                         false,
		"PREPARE q AS SELECT 1":                 false,
		"INSERT INTO t VALUES ('; COMMIT')":     false,
		`SELECT "commit" FROM t`:                false,
		"DO $$BEGIN PERFORM 1; END$$":           false,
		"DO $b$BEGIN PERFORM 1; COMMIT; END$b$": false,
		"UPDATE t SET v = 1 -- ; COMMIT":        false,
		"SELECT 1":                              false,
		"SAVEPOINT s":                           false,
		"RELEASE SAVEPOINT s":                   false,
	} {
		if got := endsTransaction(sql); got != want {
			t.Errorf("endsTransaction(%q) = %v, want %v", sql, got, want)
		}
	}
}
