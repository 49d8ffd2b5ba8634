//go:build race

package publisher

// raceEnabled says the tests run under the race detector.
const raceEnabled = true
