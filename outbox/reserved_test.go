package outbox

import (
	"slices"
	"testing"

	"github.com/outbox-relay/outbox-relay/event"
)

// The writer refuses the headers the relay would refuse: a list that drifts
// lets an event through here that the relay then quarantines.
func TestReservedHeadersAreTheRelays(t *testing.T) {
	if !slices.Equal(reservedHeaders, event.ReservedHeaders) {
		t.Fatalf("writer reserves %v, the relay %v", reservedHeaders, event.ReservedHeaders)
	}
}
