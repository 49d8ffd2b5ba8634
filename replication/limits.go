package replication

import (
	"context"
	"fmt"
	"time"
)

// SlotLimits are the server settings that invalidate a slot whose consumer
// is down or behind. Zero means unset (or unknown to this server).
type SlotLimits struct {
	// IdleTimeout is idle_replication_slot_timeout (PostgreSQL 18+): a slot
	// nobody streams from for that long is invalidated at the next
	// checkpoint.
	IdleTimeout time.Duration
	// CheckpointTimeout is checkpoint_timeout, which bounds when after the
	// idle timeout the invalidation comes.
	CheckpointTimeout time.Duration
	// MaxWALKeepBytes is max_slot_wal_keep_size: a slot that holds more
	// WAL is invalidated.
	MaxWALKeepBytes int64
}

// SlotLimits reads the settings that can invalidate the relay's slot.
func (a *Admin) SlotLimits(ctx context.Context) (SlotLimits, error) {
	rows, err := a.conn.Query(ctx, `SELECT name, setting::bigint, coalesce(unit, '') FROM pg_settings
		WHERE name IN ('idle_replication_slot_timeout', 'checkpoint_timeout', 'max_slot_wal_keep_size')`)
	if err != nil {
		return SlotLimits{}, fmt.Errorf("read slot limits: %w", err)
	}
	defer rows.Close()
	var l SlotLimits
	for rows.Next() {
		var name, unit string
		var value int64
		if err := rows.Scan(&name, &value, &unit); err != nil {
			return SlotLimits{}, fmt.Errorf("read slot limits: %w", err)
		}
		if value <= 0 {
			continue // 0 and -1 turn the limit off
		}
		switch name {
		case "max_slot_wal_keep_size":
			l.MaxWALKeepBytes = value * unitBytes(unit)
		case "idle_replication_slot_timeout":
			l.IdleTimeout = time.Duration(value) * unitDuration(unit)
		case "checkpoint_timeout":
			l.CheckpointTimeout = time.Duration(value) * unitDuration(unit)
		}
	}
	if err := rows.Err(); err != nil {
		return SlotLimits{}, fmt.Errorf("read slot limits: %w", err)
	}
	return l, nil
}

// unitDuration is a pg_settings time unit.
func unitDuration(unit string) time.Duration {
	switch unit {
	case "ms":
		return time.Millisecond
	case "min":
		return time.Minute
	case "h":
		return time.Hour
	case "d":
		return 24 * time.Hour
	}
	return time.Second
}

// unitBytes is a pg_settings size unit.
func unitBytes(unit string) int64 {
	switch unit {
	case "B":
		return 1
	case "kB":
		return 1 << 10
	case "GB":
		return 1 << 30
	case "TB":
		return 1 << 40
	}
	return 1 << 20 // MB, max_slot_wal_keep_size's unit
}

// Warnings say, for each limit that is set, how long the relay may be down
// before PostgreSQL invalidates its slot and what to do about it.
func (l SlotLimits) Warnings() []string {
	var out []string
	if l.IdleTimeout > 0 {
		out = append(out, fmt.Sprintf("idle_replication_slot_timeout is %s: if no relay streams from the slot for longer than that (stopped, crashed, or its host down), "+
			"PostgreSQL invalidates the slot at the next checkpoint (within checkpoint_timeout, %s, after that), and events committed meanwhile never reach Kafka through it. "+
			"Keep every outage of the relay shorter than %s (a second instance as a standby helps), or set idle_replication_slot_timeout to 0 or to longer than the longest outage you plan for",
			l.IdleTimeout, l.CheckpointTimeout, l.IdleTimeout))
	}
	if l.MaxWALKeepBytes > 0 {
		size := fmt.Sprintf("%d MB", l.MaxWALKeepBytes>>20)
		out = append(out, fmt.Sprintf("max_slot_wal_keep_size is %s: the relay may be down or behind only for as long as the server takes to write %s of WAL; "+
			"past that PostgreSQL invalidates the slot and events in the removed WAL never reach Kafka. "+
			"Size it for the longest outage you plan for at your peak WAL rate, or set it to -1",
			size, size))
	}
	return out
}
