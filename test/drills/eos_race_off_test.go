//go:build !race

package drills

const raceEnabled = false
