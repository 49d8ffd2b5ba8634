package relay

import (
	"context"
	"time"

	"github.com/outbox-relay/outbox-relay/replication"
)

// PollSlot keeps the slot's gauges current until ctx ends: every `every`
// it reads the slot from PostgreSQL and sets outbox_relay_slot_active,
// _slot_retained_wal_bytes, _slot_lag_bytes and _slot_wal_status, and it
// refreshes the in-flight gauges from the relay's own state. It logs once
// when the slot's wal_status becomes unreserved or lost (the server is
// about to remove, or removed, WAL the slot needs), and once when it
// recovers. It works whether this instance streams or is a standby, on a
// connection of its own.
func (r *Relay) PollSlot(ctx context.Context, every time.Duration) {
	p := &slotPoller{relay: r}
	defer p.close()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		p.poll(ctx, every)
		timer.Reset(every)
	}
}

// slotPoller is PollSlot's state between polls.
type slotPoller struct {
	relay    *Relay
	admin    *replication.Admin
	walState string // the wal_status last logged about
	failing  bool   // the last read failed, and that was logged
}

func (p *slotPoller) close() {
	if p.admin != nil {
		p.admin.Close(context.Background())
		p.admin = nil
	}
}

func (p *slotPoller) poll(ctx context.Context, every time.Duration) {
	r := p.relay
	m := r.metrics
	st := r.Status()
	m.InFlightEvents.Set(float64(st.InFlightEvents))
	m.OldestUnpublished.Set(st.OldestInFlightSeconds)

	ctx, cancel := context.WithTimeout(ctx, max(every, 10*time.Second))
	defer cancel()
	info, exists, err := p.read(ctx)
	if ctx.Err() != nil && err != nil {
		return // shutting down, or the read took too long; try again later
	}
	if err != nil || !exists {
		// Nobody can stream from a slot that cannot be read or is gone.
		m.SlotActive.Set(0)
		if !p.failing {
			p.failing = true
			ev := r.log.Warn()
			if err != nil {
				ev.Str("error", replication.RedactError(err.Error(), r.cfg.Replication.DSN)).
					Msg("cannot read the replication slot's state; the slot gauges keep their last values")
			} else {
				ev.Msg("the replication slot does not exist")
			}
		}
		return
	}
	if p.failing {
		p.failing = false
		r.log.Info().Msg("reading the replication slot's state again")
	}
	if info.Active {
		m.SlotActive.Set(1)
	} else {
		m.SlotActive.Set(0)
	}
	if info.RetainedWALBytes != nil {
		m.SlotRetainedWAL.Set(*info.RetainedWALBytes)
	}
	if info.LagBytes != nil {
		m.SlotLag.Set(*info.LagBytes)
	}
	walStatus := ""
	if info.WALStatus != nil {
		walStatus = *info.WALStatus
	}
	m.setWALStatus(walStatus)
	p.noteWALStatus(info, walStatus)
}

// read returns the slot's state, connecting first when needed. A failed
// query drops the connection, so the next poll starts afresh.
func (p *slotPoller) read(ctx context.Context) (*replication.SlotInfo, bool, error) {
	if p.admin == nil {
		admin, err := replication.Connect(ctx, p.relay.cfg.Replication)
		if err != nil {
			return nil, false, err
		}
		p.admin = admin
	}
	info, exists, err := p.admin.Slot(ctx)
	if err != nil {
		p.close()
	}
	return info, exists, err
}

// noteWALStatus logs when the slot's WAL starts or stops being at risk.
func (p *slotPoller) noteWALStatus(info *replication.SlotInfo, walStatus string) {
	r := p.relay
	atRisk := walStatus == "unreserved" || walStatus == "lost"
	switch {
	case atRisk && walStatus != p.walState:
		ev := r.log.Error().Str("wal_status", walStatus)
		if info.SafeWALSize != nil {
			ev = ev.Int64("safe_wal_size", *info.SafeWALSize)
		}
		if info.RetainedWALBytes != nil {
			ev = ev.Float64("retained_wal_bytes", *info.RetainedWALBytes)
		}
		if walStatus == "lost" {
			ev.Msg("PostgreSQL invalidated the replication slot (max_slot_wal_keep_size): events in the removed WAL can no longer be delivered; see docs/operations.md")
		} else {
			ev.Msg("the replication slot holds more WAL than max_slot_wal_keep_size allows: PostgreSQL will invalidate it at the next checkpoint unless the relay catches up")
		}
		p.walState = walStatus
	case !atRisk && p.walState != "":
		r.log.Info().Str("wal_status", walStatus).Msg("the replication slot's WAL is no longer at risk")
		p.walState = ""
	}
}
