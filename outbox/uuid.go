package outbox

import "github.com/google/uuid"

// NewID returns a new UUID version 7 (RFC 9562): Unix milliseconds, then
// a counter and random bits. IDs made later sort later, within a
// millisecond too, so new rows land at the right edge of the event_id index
// instead of all over it.
func NewID() string {
	return uuid.Must(uuid.NewV7()).String()
}

// isUUID reports whether s is a UUID in PostgreSQL's canonical text form
// (any case), the form the relay publishes as the event_id header.
func isUUID(s string) bool {
	if len(s) != 36 {
		return false
	}
	for i := 0; i < 36; i++ {
		c := s[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
				return false
			}
		}
	}
	return true
}
