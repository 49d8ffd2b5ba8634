package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/dryrun"
	"github.com/outbox-relay/outbox-relay/messages"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/poll"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
)

// sourceSpec is everything the commands know about one source of events.
// The commands read it instead of comparing source names, so a new source
// is its own package and one entry in sources.
type sourceSpec struct {
	name  string
	usage string // what --source with this name does, for -h

	// check validates the source's own settings before anything is
	// touched (a refusal exits 2), and copies them into o.relay.
	check func(o *options) error
	// run is `run` once every command's checks have passed.
	run func(ctx context.Context, o *options, log zerolog.Logger, stderr io.Writer) int
	// dryRun is `run --dry-run`: the source read as run reads it, its
	// records printed, nothing written anywhere.
	dryRun func(ctx context.Context, o *options, printer *dryrun.Printer, log zerolog.Logger, stderr io.Writer) int
	// status is `status` once the PostgreSQL settings have been checked.
	status func(ctx context.Context, o *options, stdout, stderr io.Writer) int
	// schema marks in names what migrate creates for the source.
	schema func(o *options, names *migrations.Names)

	// noSlot, when set, says why the source needs no replication slot:
	// migrate makes none, and refuses --slot-only.
	noSlot string
	// noTable, when set, says why reconcile refuses the source: its events
	// come without an outbox table, so there are no rows to compare, no
	// columns to check, and migrate's log names the source, not a table.
	noTable string
	// atLeastOnce, when set, says why the source cannot deliver
	// exactly-once.
	atLeastOnce string
}

// sources are the sources --source picks from; the first is the default.
func sources() []sourceSpec {
	return []sourceSpec{
		{
			name:   "wal",
			usage:  "stream the outbox table's inserts from a logical replication slot",
			check:  func(*options) error { return nil },
			run:    runRelay,
			dryRun: dryRunRelay,
			status: slotStatus,
			schema: func(*options, *migrations.Names) {},
		},
		{
			name:   "poll",
			usage:  "claim rows from a state table beside it, for databases where the relay cannot hold a slot (see docs/polling-or-cdc.md)",
			check:  func(*options) error { return nil },
			run:    runPoll,
			dryRun: dryRunPoll,
			status: pollStatus,
			schema: func(o *options, n *migrations.Names) {
				n.Poll, n.PollSnapshot = o.poll.Strategy != poll.StrategySnapshot, o.poll.Strategy == poll.StrategySnapshot
				n.PollQuiet = !o.poll.Notify
			},
			// A team that polls may have no REPLICATION role to make one.
			noSlot:      "poll mode needs no replication slot",
			atLeastOnce: "a poller records what it published in PostgreSQL after Kafka's ack, and no Kafka transaction can include that write, so a crash between the two publishes the batch again; use --delivery at-least-once with consumers that dedupe by event_id",
		},
		{
			name:    "messages",
			usage:   "stream events that services emit with pg_logical_emit_message, with no outbox table (see docs/messages.md)",
			check:   checkMessages,
			run:     runRelay,
			dryRun:  dryRunRelay,
			status:  slotStatus,
			schema:  func(_ *options, n *migrations.Names) { n.Messages = true },
			noTable: "reconcile compares the outbox table with Kafka, and the messages source has no table, so there is nothing to compare (see docs/messages.md for what this source gives up)",
		},
	}
}

// sourceFlag picks the source, for every command whose work differs
// between them.
func sourceFlag(fs *flag.FlagSet, o *options) {
	all := sources()
	usage := make([]string, len(all))
	for i, s := range all {
		usage[i] = s.name + ": " + s.usage
	}
	fs.StringVar(&o.source, "source", all[0].name, strings.Join(usage, "; "))
	fs.StringVar(&o.messagePrefix, "message-prefix", messages.DefaultPrefix, "with --source messages: the prefix of the logical decoding messages that are this relay's events")
}

// lookupSource is the entry of --source, or false for a name no entry has.
func lookupSource(name string) (sourceSpec, bool) {
	for _, s := range sources() {
		if s.name == name {
			return s, true
		}
	}
	return sourceSpec{}, false
}

// validateSource refuses an unknown --source, exactly-once from a source
// that cannot deliver it, and what the source's own check refuses.
func validateSource(o *options) (sourceSpec, error) {
	s, ok := lookupSource(o.source)
	if !ok {
		return s, fmt.Errorf("--source %q: use %s", o.source, sourceNames(func(sourceSpec) bool { return true }))
	}
	if err := s.check(o); err != nil {
		return s, err
	}
	if s.noSlot != "" && o.relay.OnSlotLost == relay.SlotLostRecover {
		return s, fmt.Errorf("--on-slot-lost recover with --source %s: %s, so no slot can be lost; drop the flag", s.name, s.noSlot)
	}
	if s.noSlot != "" && o.relay.ExistingRows != relay.ExistingRowsRefuse && o.relay.ExistingRows != "" {
		return s, fmt.Errorf("--existing-rows %s with --source %s: %s, so it never makes one over the table's rows; drop the flag (--poll-existing says what the snapshot strategy does with them)", o.relay.ExistingRows, s.name, s.noSlot)
	}
	if s.atLeastOnce != "" && o.relay.DeliveryMode() == relay.DeliveryExactlyOnce {
		return s, fmt.Errorf("--delivery exactly-once needs --source %s: %s", sourceNames(func(s sourceSpec) bool { return s.atLeastOnce == "" }), s.atLeastOnce)
	}
	return s, nil
}

// sourceNames lists the names of the sources keep picks, as "a, b or c".
func sourceNames(keep func(sourceSpec) bool) string {
	var names []string
	for _, s := range sources() {
		if keep(s) {
			names = append(names, s.name)
		}
	}
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// checkMessages makes the relay read messages with the prefix, and
// refuses what needs an outbox table: reconcile re-reads the table's rows,
// and there are none.
func checkMessages(o *options) error {
	if o.messagePrefix == "" || strings.ContainsRune(o.messagePrefix, 0) {
		return fmt.Errorf("--message-prefix %q: must be non-empty, with no NUL byte", o.messagePrefix)
	}
	if o.reconcile.every > 0 {
		return errors.New("--reconcile-every with --source messages: reconcile compares the outbox table with Kafka, and the messages source has no table; drop --reconcile-every (see docs/messages.md for what this source gives up)")
	}
	o.relay.Replication.Source = replication.MessageSource{Prefix: o.messagePrefix}
	return nil
}
