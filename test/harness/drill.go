package harness

import (
	"os"
	"strconv"
	"testing"
	"time"
)

// DrillSizeEnv set to "full" runs the drills at full size (make drills);
// unset, they run at the reduced size a CI run affords.
const DrillSizeEnv = "OUTBOX_RELAY_DRILL_SIZE"

// DrillSeedEnv replays a drill's random choices: set it to the seed a
// failed run logged.
const DrillSeedEnv = "OUTBOX_RELAY_DRILL_SEED"

// Sized returns full when DrillSizeEnv=full, else reduced.
func Sized(reduced, full int) int {
	if os.Getenv(DrillSizeEnv) == "full" {
		return full
	}
	return reduced
}

// DrillSeed is the seed for a drill's random choices: DrillSeedEnv's value,
// else the clock. It logs the seed, so any run can be replayed.
func DrillSeed(t testing.TB) uint64 {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv(DrillSeedEnv); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("%s=%q: %v", DrillSeedEnv, s, err)
		}
		seed = v
	}
	t.Logf("random seed %d (set %s=%d to replay)", seed, DrillSeedEnv, seed)
	return seed
}
