package publisher

import (
	"fmt"
	"sync"

	"github.com/outbox-relay/outbox-relay/sink"
)

// PoisonMemory remembers, across sessions, events Kafka refused inside a
// Kafka transaction, so a re-streamed batch cannot hit the same refusal
// forever. A refusal names its event when only one record failed with a
// permanent error, or when the record was sent alone; otherwise the records
// that failed become suspects, each sent alone next time. It is safe for
// concurrent use.
type PoisonMemory struct {
	mu       sync.Mutex
	limit    int
	refusals map[string]error
	suspects map[string]bool
	order    []string // refusals and suspects, oldest first, for the limit
}

// NewPoisonMemory keeps at most limit events (0 means 100,000); the oldest
// are forgotten first.
func NewPoisonMemory(limit int) *PoisonMemory {
	if limit <= 0 {
		limit = 100000
	}
	return &PoisonMemory{limit: limit, refusals: map[string]error{}, suspects: map[string]bool{}}
}

func (m *PoisonMemory) refused(eventID []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err, ok := m.refusals[string(eventID)]; ok {
		return fmt.Errorf("kafka refused this event inside an earlier transaction: %w", err)
	}
	return nil
}

func (m *PoisonMemory) suspect(eventID []byte) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.suspects[string(eventID)]
}

// learn records the permanent refusals of an aborted transaction and
// returns how many events it named as poison.
func (m *PoisonMemory) learn(failures []failure, isolated bool) int {
	var refused []failure
	for _, f := range failures {
		if f.record != nil && Classify(f.err) == sink.ClassPermanent {
			refused = append(refused, f)
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(refused) == 1 || isolated && len(refused) > 0 {
		f := refused[len(refused)-1] // the isolated record was sent last
		id := f.record.EventID()
		delete(m.suspects, id)
		m.remember(id)
		m.refusals[id] = f.err
		return 1
	}
	for _, f := range refused {
		id := f.record.EventID()
		if !m.suspects[id] {
			m.remember(id)
			m.suspects[id] = true
		}
	}
	return 0
}

// committed clears suspects that a committed transaction carried; ids
// yields the event ids of its records.
func (m *PoisonMemory) committed(ids func(yield func(string) bool)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.suspects) == 0 {
		return
	}
	for id := range ids {
		delete(m.suspects, id)
	}
}

func (m *PoisonMemory) remember(id string) {
	m.order = append(m.order, id)
	for len(m.order) > m.limit {
		delete(m.refusals, m.order[0])
		delete(m.suspects, m.order[0])
		m.order = m.order[1:]
	}
}
