package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/store"
)

const quarantineUsage = `usage:
  outbox-relay quarantine list [--json] [flags]
  outbox-relay quarantine replay <event_id>... | --all [flags]

replay publishes quarantined events again with their original event_id, key
and headers, and removes each from quarantine only after Kafka acknowledged
it. Fix the cause first (topic limits, topic name, ACLs).
`

func quarantineCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "list" && args[0] != "replay") {
		fmt.Fprint(stderr, quarantineUsage)
		return exitUsage
	}
	sub := args[0]
	o := &options{}
	fs := newFlagSet("outbox-relay quarantine "+sub, o, stderr)
	asJSON := fs.Bool("json", false, "list: print JSON instead of a table")
	all := fs.Bool("all", false, "replay: every quarantined event")
	timeout := fs.Duration("replay-timeout", time.Minute, "replay: how long to wait for Kafka's acknowledgements")
	if err := parse(fs, o, args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return fail(stderr, "quarantine", err, o.relay.Replication.DSN)
	}
	dsn := o.relay.Replication.DSN
	if err := o.relay.Replication.Validate(); err != nil {
		return fail(stderr, "quarantine", err, dsn)
	}
	table, err := store.QuarantineTable(o.relay.Replication.Table, o.relay.QuarantineTable)
	if err != nil {
		return fail(stderr, "quarantine", err, dsn)
	}
	access := store.ForList
	if sub == "replay" {
		access = store.ForReplay
	}
	quarantine, err := store.OpenQuarantine(ctx, o.relay.Replication, table, access)
	if err != nil {
		return fail(stderr, "quarantine", err, dsn)
	}
	defer quarantine.Close()

	if sub == "list" {
		events, err := quarantine.List(ctx, "")
		if err != nil {
			return fail(stderr, "quarantine", err, dsn)
		}
		if *asJSON {
			enc := json.NewEncoder(stdout)
			enc.SetIndent("", "  ")
			enc.Encode(events)
			return exitOK
		}
		w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "EVENT_ID\tTOPIC\tCLASS\tATTEMPTS\tLAST_FAILED\tERROR")
		for _, e := range events {
			msg := e.ErrorMessage
			if len(msg) > 120 {
				msg = msg[:117] + "..."
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%s\n", e.EventID, e.Topic, e.ErrorClass, e.Attempts,
				e.LastFailedAt.UTC().Format(time.RFC3339), msg)
		}
		w.Flush()
		fmt.Fprintf(stdout, "%d quarantined event(s)\n", len(events))
		return exitOK
	}

	ids := fs.Args()
	if *all == (len(ids) > 0) {
		return fail(stderr, "quarantine replay", errors.New("give event ids, or --all"), "")
	}
	var events []relay.Quarantined
	if *all {
		events, err = quarantine.List(ctx, "")
	} else {
		for _, id := range ids {
			one, lerr := quarantine.List(ctx, id)
			if lerr != nil {
				err = lerr
				break
			}
			if len(one) == 0 {
				return fail(stderr, "quarantine replay", fmt.Errorf("event %s is not quarantined", id), "")
			}
			events = append(events, one...)
		}
	}
	if err != nil {
		return fail(stderr, "quarantine replay", err, dsn)
	}
	if len(o.relay.Publisher.Brokers) == 0 {
		return fail(stderr, "quarantine replay", errors.New("--kafka-brokers is required"), "")
	}
	log, err := newLogger(o.logLevel, stderr)
	if err != nil {
		return fail(stderr, "quarantine replay", err, "")
	}
	results, err := relay.Replay(ctx, o.relay.Publisher, quarantine, events, *timeout, log)
	if err != nil && results == nil {
		return fail(stderr, "quarantine replay", err, dsn)
	}
	failed := 0
	for _, r := range results {
		if r.Err != nil {
			failed++
			fmt.Fprintf(stdout, "FAILED    %s: %s\n", r.EventID, replication.RedactError(r.Err.Error(), dsn))
		} else {
			fmt.Fprintf(stdout, "REPLAYED  %s to %s\n", r.EventID, r.Topic)
		}
	}
	fmt.Fprintf(stdout, "%d replayed, %d still quarantined\n", len(results)-failed, failed)
	if failed > 0 {
		return exitFailure
	}
	return exitOK
}
