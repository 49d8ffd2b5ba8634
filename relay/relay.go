// Package relay wires replication, lsn and publisher into the running relay:
// one stream session reads committed outbox rows, publishes them, and
// confirms what Kafka acknowledged; around it, a restart loop backs off and
// re-streams from the slot after any failure, and waits while another
// instance holds the slot. It also keeps the state the admin endpoint shows.
package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/layout"
	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/pipeline"
	"github.com/outbox-relay/outbox-relay/progress"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sink"
)

// Config is everything the relay needs to run.
type Config struct {
	Replication replication.Config
	// Sinks makes the sinks events go to, and the progress store.
	Sinks Sinks

	// MaxInFlightEvents and MaxInFlightBytes bound what is sent and not yet
	// acknowledged. At the bound the relay stops reading WAL. They also bound
	// the duplicates a crash can cause. Zero events means the delivery
	// mode's default (see inFlightEvents).
	MaxInFlightEvents int
	MaxInFlightBytes  int64

	// StatusInterval is how often a moved confirmed position is reported;
	// the relay reports at least every StatusMaxInterval regardless, and
	// sooner when wal_sender_timeout is short.
	StatusInterval    time.Duration
	StatusMaxInterval time.Duration

	// ShutdownTimeout bounds the wait for in-flight acks on SIGTERM.
	ShutdownTimeout time.Duration
	// KafkaStallTimeout is how long events in flight may wait with no
	// acknowledgement from Kafka before /readyz says not ready and a
	// warning is logged.
	KafkaStallTimeout time.Duration

	BackoffMin time.Duration
	BackoffMax time.Duration

	// RecreateLostSlot lets the relay drop and recreate a slot the server
	// invalidated. Events in the lost WAL are not recovered.
	RecreateLostSlot bool
	// OnSlotLost is what a session does when the slot is lost:
	// SlotLostStop (the default) or SlotLostRecover, which needs
	// Recoverer and a table source.
	OnSlotLost string
	Recoverer  Recoverer
	// ExistingRows is what to do with the rows already in the table when
	// a slot must be made that no record covers (--existing-rows):
	// ExistingRowsRefuse (the default), ExistingRowsPending or
	// ExistingRowsPublished.
	ExistingRows string

	// OnPermanentError is what happens to an event Kafka will never
	// accept: pipeline.OnPermanentQuarantine keeps it in the quarantine
	// table and goes on; pipeline.OnPermanentHalt stops the relay.
	OnPermanentError string
	// QuarantineTable is the schema-qualified quarantine table; empty means
	// outbox_quarantine in the outbox table's schema.
	QuarantineTable string

	Retention Retention

	// Progress is where the relay keeps its own progress in Kafka.
	Progress ProgressOptions

	// Delivery is DeliveryAtLeastOnce or DeliveryExactlyOnce (--delivery).
	Delivery string
	// TransactionalID overrides the exactly-once producer's transactional
	// id, derived by default from the slot and the system identifier.
	TransactionalID string
	// ReadTick is how long the WAL reader waits, once a transaction ended
	// and nothing more was read, before it reads again: at steady rates it
	// gathers several transactions per wake-up and per produce request, at
	// the cost of up to ReadTick of latency. Zero reads at once.
	ReadTick time.Duration
	// TransactionInterval is how long a Kafka transaction stays open
	// before it commits at the next source-transaction boundary.
	TransactionInterval time.Duration

	// DryRun, when set, makes the relay print instead of publish (`run
	// --dry-run`). See DryRun.
	DryRun DryRun
}

// DryRun is where a dry run's records and refused events go. A relay with
// one streams from a temporary slot of its own, dropped when its
// connection ends, so the configured slot is never read, held or moved,
// whether a relay streams it or not; and it reads or writes nothing else:
// no Kafka, no progress record, no quarantine table, no retention. It
// shows the events committed after each session starts.
type DryRun interface {
	// NewSink makes a session's sink.
	NewSink() (sink.Sink, error)
	// Put takes an event the relay would quarantine.
	Put(ctx context.Context, e Quarantined) error
}

// The default bounds on events in flight. At-least-once keeps the window
// small, since it bounds the duplicates a crash causes. Exactly-once
// reports acks only once a Kafka transaction committed, so the window must
// hold whole Kafka transactions: measured on Apache Kafka, transactions
// capped at half of 2,000 events drained a backlog at 0.34-0.44 of the
// at-least-once rate, each commit's fixed cost (AddPartitionsToTxn, EndTxn,
// the markers) repeating every 1,000 events. A crash re-delivers nothing
// to read_committed consumers in that mode, so the larger window costs no
// duplicates; the bytes bound still caps the memory.
const (
	defaultInFlightEvents            = 2000
	defaultInFlightEventsExactlyOnce = 50000
)

// inFlightEvents is the bound on events in flight: the configured one, or
// the delivery mode's default.
func (c Config) inFlightEvents() int {
	switch {
	case c.MaxInFlightEvents > 0:
		return c.MaxInFlightEvents
	case c.exactlyOnce():
		return defaultInFlightEventsExactlyOnce
	}
	return defaultInFlightEvents
}

// Delivery modes.
const (
	DeliveryAtLeastOnce = "at-least-once"
	DeliveryExactlyOnce = "exactly-once"
)

// maxReadTick bounds the latency a read tick may add to every event.
const maxReadTick = 100 * time.Millisecond

// maxTransactionInterval keeps a Kafka transaction well inside the
// producer's transaction timeout and read_committed readers' patience.
const maxTransactionInterval = 10 * time.Second

// DefaultConfig returns the defaults the relay ships with.
func DefaultConfig() Config {
	return Config{
		Replication: replication.Config{
			Config:          pg.Config{Table: "public.outbox_events"},
			Publication:     "outbox_relay",
			Slot:            "outbox_relay",
			MaxMessageBytes: replication.DefaultMaxMessageBytes,
		},
		MaxInFlightBytes:  64 << 20,
		StatusInterval:    time.Second,
		ReadTick:          2 * time.Millisecond,
		StatusMaxInterval: 10 * time.Second,
		ShutdownTimeout:   30 * time.Second,
		KafkaStallTimeout: 30 * time.Second,
		BackoffMin:        500 * time.Millisecond,
		BackoffMax:        30 * time.Second,
		OnPermanentError:  pipeline.OnPermanentQuarantine,
		OnSlotLost:        SlotLostStop,
		ExistingRows:      ExistingRowsRefuse,
		Retention:         DefaultRetention(),
		Progress:          ProgressOptions{Topic: progress.DefaultTopic},

		Delivery:            DeliveryAtLeastOnce,
		TransactionInterval: sink.DefaultTransactionInterval,
	}
}

// Validate checks the configuration and names the field at fault.
func (c Config) Validate() error {
	if err := c.Replication.Validate(); err != nil {
		return err
	}
	if c.Sinks == nil {
		return errors.New("the relay has no sinks to publish to")
	}
	if err := c.validateMessages(); err != nil {
		return err
	}
	if m, k := c.Replication.MaxMessageBytes, c.Sinks.MaxMessageBytes(); m < k {
		// A change Kafka would take could then be dropped unread.
		return fmt.Errorf("--max-message-bytes %d: below --kafka-max-message-bytes %d, it would drop events Kafka accepts; raise it to at least %d", m, k, k)
	}
	if c.ReadTick < 0 || c.ReadTick > maxReadTick {
		return fmt.Errorf("--read-tick %s: must be between 0 and %s", c.ReadTick, maxReadTick)
	}
	if c.KafkaStallTimeout <= 0 {
		return fmt.Errorf("--kafka-stall-timeout %s: must be positive", c.KafkaStallTimeout)
	}
	if c.MaxInFlightEvents < 0 {
		return fmt.Errorf("--max-in-flight-events %d: must be at least 1, or 0 for the delivery mode's default", c.MaxInFlightEvents)
	}
	if c.MaxInFlightBytes < 1 {
		return fmt.Errorf("--max-in-flight-bytes %d: must be at least 1", c.MaxInFlightBytes)
	}
	if err := pipeline.ValidateOnPermanent(c.OnPermanentError); err != nil {
		return err
	}
	if _, err := c.quarantineTable(); err != nil {
		return err
	}
	if err := c.ValidateDelivery(); err != nil {
		return err
	}
	if err := c.validateProgressTopic(); err != nil {
		return err
	}
	if err := c.validateOnSlotLost(); err != nil {
		return err
	}
	if err := c.validateExistingRows(); err != nil {
		return err
	}
	return c.Retention.validate()
}

// validateMessages refuses, for the messages source, what needs an outbox
// table.
func (c Config) validateMessages() error {
	if c.Replication.ReadsTable() {
		return nil
	}
	if c.Retention.After > 0 {
		return fmt.Errorf("--retention %s with --source messages: there is no outbox table to delete from (the messages leave the WAL once the slot confirms them); drop --retention", c.Retention.After)
	}
	if l := c.Replication.OutboxLayout(); l.Shape != layout.ShapeRelay || l.Columns != layout.Relay.Columns || len(l.HeaderColumns) > 0 {
		return errors.New("--outbox-layout and the column flags with --source messages: a message's content has the relay's own fields, whatever --record-format makes of them; drop them")
	}
	return nil
}

// validateProgressTopic refuses a progress topic that an event could be
// routed to. Events and progress records would then share a topic: the
// relay creates it compacted, so Kafka would keep only the last event of
// each aggregate, and consumers would read progress records as events.
func (c Config) validateProgressTopic() error {
	if c.Progress.Topic == "" {
		return nil
	}
	clash, err := c.Sinks.CanName(c.Progress.Topic)
	if err != nil || !clash {
		return nil // a bad --topic is reported by the publisher's own check
	}
	return fmt.Errorf("--progress-topic %s: --topic %s can name it, so events and progress records would share one topic (compacted: Kafka would keep only the last event of each aggregate, and consumers would read progress records as events); "+
		"choose a progress topic the template can never produce (the default is %s), or give --topic a fixed prefix or suffix",
		c.Progress.Topic, c.Sinks.TopicTemplate(), progress.DefaultTopic)
}

// Relay runs stream sessions until its context ends or a fatal error.
type Relay struct {
	cfg     Config
	log     zerolog.Logger
	metrics *Metrics
	hooks   Hooks
	clock   clock // the wall clock; tests drive the WAL reader and restarts with a fake

	// report is what the WAL readers publish about their reading.
	report readReport

	// slot is what the slot watch's readings say of the slot's position.
	slot slotView

	mu     sync.Mutex
	status Status

	progress *progressKeeper
	delivery *exactlyOnce

	// skips are the kinds of skipped message logged so far.
	skips skipNotes
}

// Hooks let the process around the relay react to its progress: Running
// is called each time a session starts streaming, Alive from the engine loop
// at least once per StatusInterval while it makes progress.
type Hooks = pipeline.Hooks

// New returns a relay; metrics may be nil.
func New(cfg Config, log zerolog.Logger, metrics *Metrics, hooks Hooks) *Relay {
	if metrics == nil {
		metrics = NewMetrics(nil)
	}
	log = log.With().Str("slot", cfg.Replication.Slot).Logger()
	progress := &progressKeeper{cfg: cfg, log: log, metrics: metrics.progress}
	return &Relay{cfg: cfg, log: log, metrics: metrics, hooks: hooks,
		status:   Status{Status: pipeline.Status{State: pipeline.StateStarting}},
		progress: progress, delivery: newExactlyOnce(cfg, log, metrics.txn, progress),
		clock: pipeline.WallClock{}, skips: skipNotes{}}
}

// loopEnv is what this relay gives each session's read loop.
func (r *Relay) loopEnv() loopEnv {
	return loopEnv{cfg: r.cfg.loop(), log: r.log, metrics: r.metrics, report: &r.report, slot: &r.slot,
		keeper: r.progress, delivery: r.delivery, alive: r.hooks.Alive, clock: r.clock, skips: &r.skips}
}

// IsFatal reports whether an error needs the operator: retrying cannot fix it.
func IsFatal(err error) bool {
	var perr *sink.Error
	return pipeline.IsFatal(err) || errors.Is(err, replication.ErrSlotLost) ||
		errors.Is(err, replication.ErrSlotMissing) || errors.Is(err, replication.ErrPublicationGone) ||
		errors.As(err, &perr) && perr.Class == sink.ClassPermanent ||
		isProgressFatal(err) || errors.Is(err, ErrSlotUnrecoverable) || errors.Is(err, replication.ErrExistingRows) ||
		errors.Is(err, ErrRecoveryHalted)
}

// Run streams until ctx ends (returning nil after a clean drain) or a fatal
// error occurs. Transient failures restart the session from the slot after
// a backoff with jitter.
func (r *Relay) Run(ctx context.Context) error {
	// Background parts live exactly as long as Run.
	bgCtx, stopBackground := context.WithCancel(ctx)
	var background sync.WaitGroup
	defer func() {
		stopBackground()
		background.Wait()
	}()
	defer r.progress.close() // after the last session: writes its last position
	if r.cfg.Retention.After > 0 && r.cfg.DryRun == nil {
		background.Add(1)
		go func() {
			defer background.Done()
			retention := &retainer{cfg: r.cfg, log: r.log, metrics: r.metrics, read: &r.report, stored: r.progress.lastCommit}
			retention.run(bgCtx)
		}()
	}
	if r.cfg.DryRun == nil { // a dry run has no slot of its own to watch
		background.Add(1)
		go func() {
			defer background.Done()
			r.WatchSlot(bgCtx, 5*time.Second)
		}()
	}
	background.Add(1)
	go func() {
		defer background.Done()
		r.watchStall(bgCtx, time.Second)
	}()
	return r.restartLoop(ctx)
}

// restartLoop runs sessions until ctx ends or a fatal error.
func (r *Relay) restartLoop(ctx context.Context) error {
	loop := pipeline.Restarts{Source: &walSource{r: r}, Log: r.log, Clock: r.clock, Metrics: r.metrics.Metrics,
		BackoffMin: r.cfg.BackoffMin, BackoffMax: r.cfg.BackoffMax, ResetAfter: time.Minute,
		BatchLimit: r.cfg.Sinks.MaxMessageBytes()}
	return loop.Run(ctx)
}

// walSource is the relay's side of the restart loop.
type walSource struct {
	r *Relay
	// fencedInARow counts fences with no session in between that found
	// the slot held: the one who fenced this relay is then not streaming
	// this slot.
	fencedInARow int
}

func (w *walSource) Session(ctx context.Context, batchLimit int) (bool, error) {
	return w.r.session(ctx, batchLimit)
}

func (w *walSource) SetState(state pipeline.State, err error) { w.r.setState(state, err) }

func (w *walSource) Fatal(err error) (error, bool) {
	if errors.Is(err, replication.ErrPublicationGone) {
		err = w.r.publicationGoneError(err)
	}
	return err, IsFatal(err)
}

func (w *walSource) FailureMessage(streamed bool) string {
	switch {
	case !streamed:
		return "could not start streaming; retrying"
	case w.r.cfg.exactlyOnce():
		return "stream stopped; restarting from the slot's confirmed position (events after it are sent again in new Kafka transactions; read_committed consumers see each once)"
	}
	return "stream stopped; restarting from the slot's confirmed position (events after it are re-delivered)"
}

func (w *walSource) Waiting(err error) (pipeline.State, string) {
	log := w.r.log
	if errors.Is(err, sink.ErrFenced) {
		// Another instance initialised a producer with this
		// transactional id: it owns the stream now, and this one must
		// not commit again. Its producer is gone with the session; the
		// next session finds the slot held and waits as a standby, or
		// takes over if the other instance is gone already. Stopping
		// instead would leave no standby when the other one fails.
		w.fencedInARow++
		if w.fencedInARow < 2 {
			log.Warn().Err(err).Msg("fenced by another relay with the same transactional id; going back to standby (if this repeats while no other relay streams this slot, two relays share --transactional-id: give each slot its own)")
		} else {
			// Safe, as each fence aborts the open transaction and the
			// next session re-streams from this slot's progress; but
			// the two relays keep taking turns.
			log.Error().Err(err).Int("fences_in_a_row", w.fencedInARow).
				Msg("fenced again, and no other relay held this slot in between: a relay of another slot or database uses the same transactional id. Give each slot its own --transactional-id, or leave it unset (the default is derived from the slot and the system identifier). Nothing is lost meanwhile: each fenced Kafka transaction aborts and is re-streamed from this slot's progress, but both relays stall in turns")
		}
	}
	if errors.Is(err, replication.ErrSlotBusy) {
		w.fencedInARow = 0
	}
	return waitingState(err)
}

// waitingState is the state a session's error leaves the relay waiting in,
// and what to log when the wait begins; "" when the error is a failure.
func waitingState(err error) (pipeline.State, string) {
	switch {
	case errors.Is(err, replication.ErrSlotBusy) || errors.Is(err, sink.ErrFenced):
		return pipeline.StateWaitingForSlot, "slot is held by another process; waiting to take over (this instance is a standby)"
	case errors.Is(err, replication.ErrStandby):
		// Promotion is what a failover does; the relay streams from the
		// promoted server at its next poll.
		return pipeline.StateWaitingForPromotion, "the PostgreSQL server is a hot standby; waiting for it to be promoted, then streaming from it"
	}
	return "", ""
}
