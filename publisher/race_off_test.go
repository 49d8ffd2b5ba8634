//go:build !race

package publisher

const raceEnabled = false
