//go:build race

package drills

// raceEnabled says the drills run under the race detector.
const raceEnabled = true
