package relay

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/outbox-relay/outbox-relay/engine"
	"github.com/outbox-relay/outbox-relay/internal/await"
	"github.com/outbox-relay/outbox-relay/lsn"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
	"github.com/outbox-relay/outbox-relay/store"
)

// session is one life of the stream: check, open the slot, publish and
// confirm until an error or ctx ends. Every failure ends the session; the
// next one re-reads from the slot's confirmed position. streamed says
// whether it got as far as streaming. Its producers build batches of at
// most batchLimit bytes.
func (r *Relay) session(ctx context.Context, batchLimit int) (streamed bool, err error) {
	r.setState(pipeline.StateConnecting, nil)
	if r.cfg.DryRun != nil {
		return r.dryRunSession(ctx)
	}
	var sys replication.System
	newSink := func() (sink.Sink, error) {
		if r.cfg.exactlyOnce() {
			return r.delivery.newSink(batchLimit, sys)
		}
		return r.cfg.Sinks.New(batchLimit)
	}
	// connectSink is newSink for this session's start, given up when ctx
	// ends; waitForKafka makes its own producers.
	connectSink := func() (sink.Sink, error) {
		return await.Do(ctx, newSink, func(s sink.Sink) { s.Close(time.Second) })
	}
	// The quarantine table is opened, and its privileges checked, after
	// the server's checks and before prepare may create the slot: a start
	// that fails on it must not leave a slot nobody reads holding WAL.
	var quarantineTable *store.Quarantine
	defer func() {
		if quarantineTable != nil {
			quarantineTable.Close()
		}
	}()
	openQuarantine := func() error {
		if r.cfg.OnPermanentError != pipeline.OnPermanentQuarantine {
			return nil
		}
		var err error
		quarantineTable, err = r.openQuarantine(ctx, store.ForRelay)
		return err
	}
	var snk sink.Sink
	start, senderTimeout, err := r.prepare(ctx, openQuarantine, func(s replication.System) error {
		sys = s
		if !r.cfg.exactlyOnce() {
			return nil
		}
		// Fence before the progress is read: an older producer that
		// committed after the read would make it stale.
		var err error
		snk, err = connectSink()
		return err
	})
	closeSink := func() {
		if snk != nil {
			snk.Close(time.Second)
		}
	}
	if err != nil {
		closeSink()
		return false, err
	}

	tracker := lsn.NewTracker(start, lsn.Limits{Events: r.cfg.inFlightEvents(), Bytes: r.cfg.MaxInFlightBytes})
	var quarantine *engine.Quarantiner
	if quarantineTable != nil {
		quarantine = engine.NewQuarantiner(quarantineTable.Table().String(), quarantineTable, r.cfg.inFlightEvents()+2, quarantineStored)
	}
	if snk == nil {
		if snk, err = connectSink(); err != nil {
			quarantine.Stop()
			return false, err
		}
	}
	keepaliveEvery := statusMaxInterval(r.cfg.StatusMaxInterval, senderTimeout)
	stream, err := replication.OpenStream(ctx, r.cfg.Replication)
	if err != nil {
		closeSink()
		quarantine.Stop()
		return false, err
	}
	if err := stream.Start(ctx, start); err != nil {
		stream.Close(context.Background())
		closeSink()
		quarantine.Stop()
		return false, err
	}

	s := newWALReader(r.loopEnv(), stream, tracker, start, keepaliveEvery, newLiveness(r.cfg.Replication.DeadAfter, senderTimeout, keepaliveEvery))
	if s.txnSink {
		s.progress = r.progress.txnProgress()
	} else {
		s.feed = r.progress.feed()
	}
	loop := engine.New(r.engineConfig(s, quarantine, newSink), s, snk)
	s.takeRetries = loop.TakeRetries
	r.setStreaming(tracker)
	r.log.Info().Str("start_lsn", start.String()).Str("delivery", r.cfg.DeliveryMode()).
		Str("status_interval", r.cfg.StatusInterval.String()).Str("keepalive_every", s.keepaliveEvery.String()).Msg("streaming")
	if r.hooks.Running != nil {
		r.hooks.Running()
	}
	return true, loop.Run(ctx)
}

// prepare checks the server and the slot and returns where to start.
// beforeSlot runs after the server's checks and before the slot is
// prepared; beforeResume runs once the slot is ready and before the
// progress record is read.
func (r *Relay) prepare(ctx context.Context, beforeSlot func() error, beforeResume func(replication.System) error) (start lsn.LSN, senderTimeout time.Duration, err error) {
	admin, err := replication.Connect(ctx, r.cfg.Replication)
	if err != nil {
		return 0, 0, err
	}
	defer admin.Close(context.Background())
	if err := admin.RequirePrimary(ctx); err != nil {
		return 0, 0, err
	}
	// Everything that can be checked is checked before PrepareSlot: a
	// start that fails after creating the slot leaves it holding WAL.
	if err := admin.Check(ctx); err != nil {
		return 0, 0, err
	}
	if r.cfg.Replication.ReadsTable() { // pollers poll a table
		if err := admin.CheckNoPollers(ctx); err != nil {
			return 0, 0, err
		}
	}
	if r.cfg.Retention.After > 0 {
		if err := admin.CheckRetention(ctx); err != nil {
			return 0, 0, err
		}
	}
	if r.cfg.Recoverer != nil {
		// Found now, not when a slot is lost: by then the refusal would
		// name a flag the operator should have fixed at deploy time.
		if err := admin.CheckRepublish(ctx); err != nil {
			return 0, 0, err
		}
	}
	if err := beforeSlot(); err != nil {
		return 0, 0, err
	}
	senderTimeout, err = admin.SenderTimeout(ctx)
	if err != nil {
		return 0, 0, err
	}
	slot, sys, err := r.prepareSlot(ctx, admin, beforeResume)
	if err != nil {
		return 0, 0, err
	}
	start, err = r.progress.resume(ctx, slot, sys) // where Kafka already holds everything, if later than the slot
	return start, senderTimeout, err
}

// prepareSlot makes the slot ready to stream and returns where it starts:
// PrepareSlot's policy, or under --on-slot-lost recover, a lost slot
// replaced and its gap republished from the table. beforeResume runs once,
// before the progress record is read, and in exactly-once mode before a
// recovery reads Kafka.
func (r *Relay) prepareSlot(ctx context.Context, admin *replication.Admin, beforeResume func(replication.System) error) (replication.SlotStart, replication.System, error) {
	existing := ""
	if r.cfg.Replication.ReadsTable() {
		slot, sys, found, handled, err := r.prepareTableSlot(ctx, admin, beforeResume)
		if err != nil || handled {
			return slot, sys, err
		}
		existing = found
	}
	policy := r.slotPolicy()
	policy.BeforeCreate = r.beforeSlotCreate
	before := time.Now()
	if existing != "" && existing != replication.ExistingAdopted {
		// The slot is missing, and findSlotLoss checked Kafka already.
		policy.BeforeCreate = nil
		var err error
		if before, err = admin.Clock(ctx); err != nil {
			return replication.SlotStart{}, replication.System{}, err
		}
	}
	slot, err := admin.PrepareSlot(ctx, policy)
	if err != nil {
		return slot, replication.System{}, err
	}
	r.logSlotCreated(ctx, admin, slot)
	switch {
	case slot.RecreatedLost:
		r.recordSlot(ctx, admin, replication.SlotRecord{LSN: slot.LSN, CreatedAt: before, CreatedBy: "run", ExistingRows: replication.ExistingPublished})
	case slot.Created && existing != "":
		r.recordSlot(ctx, admin, replication.SlotRecord{LSN: slot.LSN, CreatedAt: before, CreatedBy: "run", ExistingRows: existing})
	case existing == replication.ExistingAdopted:
		// A slot older than its record: made by an earlier version, or
		// by a process killed before it wrote the record.
		r.recordSlot(ctx, admin, replication.SlotRecord{LSN: slot.LSN, CreatedAt: before, CreatedBy: "adopted", ExistingRows: existing})
	}
	sys, err := replication.IdentifySystem(ctx, r.cfg.Replication)
	if err != nil {
		return slot, sys, err
	}
	return slot, sys, beforeResume(sys)
}

// beforeSlotCreate checks Kafka before the relay creates its slot: that
// the brokers answer, and that the progress topic exists or can be made
// (its store is opened now, and kept for resume). Either failing after the
// slot was made would leave it holding WAL with no relay to read it.
func (r *Relay) beforeSlotCreate(ctx context.Context) error {
	if err := r.checkKafka(ctx); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, progressTimeout)
	defer cancel()
	if _, err := r.progress.open(ctx); err != nil {
		return fmt.Errorf("the replication slot was not created: %w", err)
	}
	return nil
}

// checkKafka connects to the brokers once before the relay creates its
// slot: a slot no relay streams from holds WAL for good, so a run that
// cannot reach Kafka (a wrong address or password) must not leave one.
func (r *Relay) checkKafka(ctx context.Context) error {
	r.log.Info().Strs("brokers", r.cfg.Sinks.Brokers()).Msg("the replication slot does not exist: checking Kafka before creating it")
	_, err := await.Do(ctx, func() (struct{}, error) { return struct{}{}, r.cfg.Sinks.Check() }, func(struct{}) {})
	if err != nil {
		return fmt.Errorf("the replication slot was not created, as Kafka is not reachable yet: %w", err)
	}
	return nil
}

// dryRunSession is a session of a dry run (see DryRun): the server's
// checks, then a temporary slot streamed into the dry run's sink.
func (r *Relay) dryRunSession(ctx context.Context) (streamed bool, err error) {
	admin, err := replication.Connect(ctx, r.cfg.Replication)
	if err != nil {
		return false, err
	}
	err = admin.Check(ctx)
	var senderTimeout time.Duration
	if err == nil {
		senderTimeout, err = admin.SenderTimeout(ctx)
	}
	admin.Close(context.Background())
	if err != nil {
		return false, err
	}
	snk, err := r.cfg.DryRun.NewSink()
	if err != nil {
		return false, err
	}
	keepaliveEvery := statusMaxInterval(r.cfg.StatusMaxInterval, senderTimeout)
	stream, err := replication.OpenStream(ctx, r.cfg.Replication)
	if err != nil {
		snk.Close(time.Second)
		return false, err
	}
	slot := dryRunSlot(r.cfg.Replication.Slot, os.Getpid())
	start, err := stream.StartTemporary(ctx, slot)
	if err != nil {
		stream.Close(context.Background())
		snk.Close(time.Second)
		return false, err
	}
	tracker := lsn.NewTracker(start, lsn.Limits{Events: r.cfg.inFlightEvents(), Bytes: r.cfg.MaxInFlightBytes})
	var quarantine *engine.Quarantiner // under halt, the dry run stops where the relay would
	if r.cfg.OnPermanentError == pipeline.OnPermanentQuarantine {
		quarantine = engine.NewQuarantiner("the dry run's output", r.cfg.DryRun, r.cfg.inFlightEvents()+2,
			"dry run: the relay would quarantine this event (printed on stdout, written nowhere)")
	}
	s := newWALReader(r.loopEnv(), stream, tracker, start, keepaliveEvery, newLiveness(r.cfg.Replication.DeadAfter, senderTimeout, keepaliveEvery))
	loop := engine.New(r.engineConfig(s, quarantine, r.cfg.DryRun.NewSink), s, snk)
	s.takeRetries = loop.TakeRetries
	r.setStreaming(tracker)
	r.log.Info().Str("temporary_slot", slot).Str("start_lsn", start.String()).
		Msg("dry run: printing the records of events committed from now on, from a temporary slot; nothing is published, and the configured slot is not touched")
	if r.hooks.Running != nil {
		r.hooks.Running()
	}
	return true, loop.Run(ctx)
}

// dryRunSlot names a dry run's temporary slot after the configured one and
// the process, so dry runs beside each other and beside the relay never
// clash, within the 63 bytes a slot name may have.
func dryRunSlot(slot string, pid int) string {
	suffix := fmt.Sprintf("_dry_run_%d", pid)
	if len(slot)+len(suffix) > 63 {
		slot = slot[:63-len(suffix)]
	}
	return slot + suffix
}
