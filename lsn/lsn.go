// Package lsn decides which WAL position is safe to confirm to PostgreSQL.
//
// It keeps an ordered record of the transactions the relay has read from the
// replication slot and counts the Kafka acknowledgements each still waits for.
// The confirmed position only ever moves to the end of a transaction that is
// fully acknowledged and whose predecessors are all fully acknowledged, so a
// crash at any moment re-delivers events instead of losing them. The package
// does no I/O; it is the most heavily unit-tested code in the relay.
package lsn

import (
	"fmt"
)

// LSN is a position in PostgreSQL's write-ahead log.
type LSN uint64

// String formats the position the way PostgreSQL does, e.g. "16/B374D848".
func (l LSN) String() string {
	return fmt.Sprintf("%X/%X", uint32(l>>32), uint32(l))
}

// Parse reads a position written the way PostgreSQL writes it.
func Parse(s string) (LSN, error) {
	var hi, lo uint32
	if _, err := fmt.Sscanf(s, "%X/%X", &hi, &lo); err != nil {
		return 0, fmt.Errorf("parse lsn %q: %w", s, err)
	}
	return LSN(uint64(hi)<<32 | uint64(lo)), nil
}
