package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/store"
)

const quarantineUsage = `usage:
  outbox-relay quarantine list [--json] [--replayed] [flags]
  outbox-relay quarantine replay <event_id>... | --all [flags]

replay publishes quarantined events again with their original event_id, key
and headers, and marks each replayed (with the topic) only after Kafka
acknowledged it; reconcile then counts it as delivered. Fix the cause first
(topic limits, topic name, ACLs). list shows the events waiting for a replay;
--replayed adds those replayed.
`

func quarantineCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "list" && args[0] != "replay") {
		fmt.Fprint(stderr, quarantineUsage)
		return exitUsage
	}
	sub := args[0]
	command := "quarantine " + sub
	maxArgs := 0
	if sub == "replay" {
		maxArgs = math.MaxInt
	}
	o, ids, code := setup(command, args[1:], maxArgs, stderr)
	if o == nil {
		return code
	}
	dsn := o.relay.Replication.DSN
	if err := validateQuarantine(o, sub, ids); err != nil {
		return usageError(stderr, command, err, dsn)
	}
	log, err := newLogger(o.logLevel, stderr)
	if err != nil {
		return usageError(stderr, command, err, "")
	}
	table, err := store.QuarantineTable(o.relay.Replication.Table, o.relay.QuarantineTable)
	if err != nil {
		return failure(stderr, command, err, dsn)
	}
	access := store.ForList
	if sub == "replay" {
		access = store.ForReplay
	}
	quarantine, err := store.OpenQuarantine(ctx, o.relay.Replication.Config, table, access)
	if err != nil {
		return failure(stderr, command, err, dsn)
	}
	defer quarantine.Close()

	if sub == "list" {
		events, err := quarantine.List(ctx, store.Selection{Replayed: o.listReplayed})
		if err != nil {
			return failure(stderr, command, err, dsn)
		}
		if o.asJSON {
			enc := json.NewEncoder(stdout)
			enc.SetIndent("", "  ")
			enc.Encode(events)
			return exitOK
		}
		w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		replayedColumn := ""
		if o.listReplayed {
			replayedColumn = "REPLAYED\t"
		}
		fmt.Fprintln(w, "EVENT_ID\tTOPIC\tCLASS\tATTEMPTS\tLAST_FAILED\t"+replayedColumn+"ERROR")
		replayed := 0
		for _, e := range events {
			msg := e.ErrorMessage
			if len(msg) > 120 {
				msg = msg[:117] + "..."
			}
			switch {
			case e.Raw != nil:
				msg = fmt.Sprintf("[raw: %d bytes, sha256 %x] %s", e.RawSize, e.RawSHA256, msg)
			case e.RawSize > 0:
				msg = fmt.Sprintf("[not kept: %d bytes, sha256 %x] %s", e.RawSize, e.RawSHA256, msg)
			}
			if e.ContentProblem != "" {
				msg = "[replay refuses: content_problem] " + msg
			}
			if o.listReplayed {
				state := "-"
				if e.ReplayedAt != nil {
					replayed++
					state = e.ReplayedAt.UTC().Format(time.RFC3339) + " to " + e.ReplayedTopic
				}
				msg = state + "\t" + msg
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%s\n", e.EventID, e.Topic, e.ErrorClass, e.Attempts,
				e.LastFailedAt.UTC().Format(time.RFC3339), msg)
		}
		w.Flush()
		if o.listReplayed {
			fmt.Fprintf(stdout, "%d quarantined event(s), %d of them replayed\n", len(events), replayed)
		} else {
			fmt.Fprintf(stdout, "%d quarantined event(s) waiting for a replay (--replayed also lists those replayed)\n", len(events))
		}
		return exitOK
	}

	var events []relay.Quarantined
	if o.replayAll {
		events, err = quarantine.List(ctx, store.Selection{})
	} else {
		for _, id := range ids {
			one, lerr := quarantine.List(ctx, store.Selection{EventID: id})
			if lerr != nil {
				err = lerr
				break
			}
			if len(one) == 0 {
				return failure(stderr, command, fmt.Errorf("event %s is not quarantined (see outbox-relay quarantine list)", id), "")
			}
			events = append(events, one...)
		}
	}
	if err != nil {
		return failure(stderr, command, err, dsn)
	}
	quarantinedFrom := make(map[string]string, len(events))
	for _, e := range events {
		quarantinedFrom[e.EventID] = e.Topic
	}
	results, err := relay.Replay(ctx, publisher.NewKafka(o.kafkaConfig(log), log), o.relay.Replication.OutboxLayout(), quarantine, events, o.replayTimeout, log)
	if err != nil && results == nil {
		return failure(stderr, command, err, dsn)
	}
	failed, refused := 0, 0
	for _, r := range results {
		switch {
		case errors.Is(r.Err, relay.ErrReplayRefused):
			refused++
			fmt.Fprintf(stdout, "REFUSED   %s: %s\n", r.EventID, operatorMessage(r.Err, dsn))
		case r.Err != nil:
			fmt.Fprintf(stdout, "FAILED    %s: %s\n", r.EventID, operatorMessage(r.Err, dsn))
		default:
			fmt.Fprintf(stdout, "REPLAYED  %s to %s%s\n", r.EventID, r.Topic, otherTopic(r.Topic, quarantinedFrom[r.EventID]))
		}
		if r.Err != nil {
			failed++
		}
	}
	fmt.Fprintf(stdout, "%d replayed, %d still waiting for a replay (%d of them refused: fix their rows first)\n", len(results)-failed, failed, refused)
	if failed > 0 {
		return exitFailure
	}
	return exitOK
}

// validateQuarantine checks a quarantine subcommand's flags and arguments
// before anything is touched.
func validateQuarantine(o *options, sub string, ids []string) error {
	if err := o.relay.Replication.Validate(); err != nil {
		return err
	}
	if err := validateQuarantineTable(o); err != nil {
		return err
	}
	if sub != "replay" {
		return nil
	}
	if o.replayAll == (len(ids) > 0) {
		return errors.New("give event ids, or --all")
	}
	for _, id := range ids {
		if !isUUID(id) {
			return fmt.Errorf("%q is not an event id: event ids are UUIDs, as `outbox-relay quarantine list` shows them", id)
		}
	}
	return o.requireBrokers()
}

// isUUID reports whether s is a UUID in a form PostgreSQL's uuid type
// takes: 32 hex digits, optionally with hyphens and braces.
func isUUID(s string) bool {
	s = strings.TrimSuffix(strings.TrimPrefix(s, "{"), "}")
	s = strings.ReplaceAll(s, "-", "")
	if len(s) != 32 {
		return false
	}
	for _, c := range s {
		if !strings.ContainsRune("0123456789abcdefABCDEF", c) {
			return false
		}
	}
	return true
}

// otherTopic says so when a replay went to another topic than the one the
// event was quarantined from: with a --topic other than run's, consumers
// of run's topics never see it.
func otherTopic(replayed, quarantined string) string {
	if quarantined == "" || quarantined == replayed {
		return ""
	}
	return fmt.Sprintf(" (quarantined from %s: if run routes with another --topic, replay with the same one)", quarantined)
}
