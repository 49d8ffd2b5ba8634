package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/pg"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/store"
)

const partitionsUsage = `usage:
  outbox-relay partitions show [--json] [flags]
  outbox-relay partitions adopt --event-topic T --consumer-groups G1,G2 [--partitions N] [flags]

The relay maps each event topic's keys by the partition count it recorded
the first time it published to the topic, so adding partitions moves no
key and breaks no aggregate's order; the new partitions get nothing. show
prints each topic's recorded count next to the count the brokers report.
adopt records a topic's new count, so the relay spreads keys over every
partition from its next start. It refuses while a relay runs on this
table or slot, and until every named consumer group has read the topic to
its end. The procedure: docs/partitions.md.
`

// adoptFlags are partitions adopt's own flags.
type adoptFlags struct {
	topic      string
	groups     string
	partitions int
}

func partitionsShowFlags(fs *flag.FlagSet, o *options) {
	fs.BoolVar(&o.asJSON, "json", false, "print JSON instead of a table")
}

func partitionsAdoptFlags(fs *flag.FlagSet, o *options) {
	fs.StringVar(&o.adopt.topic, "event-topic", "", "the event topic whose partition count to adopt, a topic name (required)")
	fs.StringVar(&o.adopt.groups, "consumer-groups", "", "comma-separated consumer groups that read the topic; each must have committed offsets at the end of every partition (required)")
	fs.IntVar(&o.adopt.partitions, "partitions", 0, "the count to map keys by from now on (default: the topic's partition count now); at most the topic's count")
	fs.StringVar(&o.logLevel, "log-level", o.logLevel, "log level: debug, info, warn, error")
}

func partitionsCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "show" && args[0] != "adopt") {
		fmt.Fprint(stderr, partitionsUsage)
		return exitUsage
	}
	command := "partitions " + args[0]
	o, _, code := setup(command, args[1:], 0, stderr)
	if o == nil {
		return code
	}
	dsn := o.relay.Replication.DSN
	if err := validatePartitions(o, args[0]); err != nil {
		return usageError(stderr, command, err, dsn)
	}
	registry, err := store.NewPartitions(o.relay.Replication.Config)
	if err != nil {
		return usageError(stderr, command, err, dsn)
	}
	ctx, cancel := context.WithTimeout(ctx, o.kafka.Timeout+30*time.Second)
	defer cancel()
	conn, err := pg.Dial(ctx, o.relay.Replication.Config)
	if err != nil {
		return failure(stderr, command, err, dsn)
	}
	defer conn.Close(context.Background())
	client, err := publisher.NewReadClient(o.kafka)
	if err != nil {
		return failure(stderr, command, err, dsn)
	}
	defer client.Close()
	if args[0] == "show" {
		return showPartitions(ctx, o, registry, conn, client, stdout, stderr)
	}
	return adoptPartitions(ctx, o, registry, conn, client, stdout, stderr)
}

func validatePartitions(o *options, sub string) error {
	if err := o.relay.Replication.Validate(); err != nil {
		return err
	}
	if err := o.requireBrokers(); err != nil {
		return err
	}
	if err := o.kafka.Validate(); err != nil {
		return err
	}
	if sub == "show" {
		return nil
	}
	if o.adopt.topic == "" {
		return errors.New("--event-topic is required: the topic whose partition count to adopt (outbox-relay partitions show lists them)")
	}
	if len(groupList(o.adopt.groups)) == 0 {
		return errors.New("--consumer-groups is required: every consumer group that reads the topic, comma-separated; adopt checks that each has read the topic to its end, so no consumer meets an aggregate's newer events on another partition before its older ones")
	}
	if o.adopt.partitions < 0 {
		return fmt.Errorf("--partitions %d: must be positive (or left out for the topic's count now)", o.adopt.partitions)
	}
	return nil
}

func groupList(s string) []string {
	var out []string
	for _, g := range strings.Split(s, ",") {
		if g = strings.TrimSpace(g); g != "" {
			out = append(out, g)
		}
	}
	return out
}

// topicRow is one topic as partitions show prints it.
type topicRow struct {
	store.RecordedTopic
	Actual int32  `json:"partitions"`
	Error  string `json:"error,omitempty"`
	State  string `json:"state"`
}

func showPartitions(ctx context.Context, o *options, registry *store.Partitions, conn *pgx.Conn, client sarama.Client, stdout, stderr io.Writer) int {
	recorded, err := registry.List(ctx, conn)
	if err != nil {
		return failure(stderr, "partitions show", err, o.relay.Replication.DSN)
	}
	rows := make([]topicRow, len(recorded))
	for i, r := range recorded {
		rows[i] = topicRow{RecordedTopic: r}
		n, err := publisher.TopicPartitionCount(client, r.Topic)
		switch {
		case err != nil:
			rows[i].Error, rows[i].State = err.Error(), "unknown"
		case n == r.Partitions:
			rows[i].Actual, rows[i].State = n, "in use"
		case n > r.Partitions:
			rows[i].Actual, rows[i].State = n, fmt.Sprintf("partitions %d-%d unused: adopt after the consumers caught up", r.Partitions, n-1)
		default:
			rows[i].Actual, rows[i].State = n, "fewer than recorded: the relay stops; recreate the topic or adopt"
		}
	}
	if o.asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		enc.Encode(rows)
		return exitOK
	}
	w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "TOPIC\tRECORDED\tPARTITIONS\tRECORDED_AT\tBY\tSTATE")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%d\t%d\t%s\t%s\t%s\n", r.Topic, r.Partitions, r.Actual, r.RecordedAt.UTC().Format(time.RFC3339), r.RecordedBy, r.State)
	}
	w.Flush()
	fmt.Fprintf(stdout, "%d event topic(s) recorded in %s\n", len(rows), registry.Table())
	return exitOK
}

func adoptPartitions(ctx context.Context, o *options, registry *store.Partitions, conn *pgx.Conn, client sarama.Client, stdout, stderr io.Writer) int {
	const command = "partitions adopt"
	dsn, topic := o.relay.Replication.DSN, o.adopt.topic
	fail := func(format string, args ...any) int {
		fmt.Fprintf(stderr, "outbox-relay %s: %s\n", command, pg.RedactError(fmt.Sprintf(format, args...), dsn))
		return exitFailure
	}
	recorded, err := registry.List(ctx, conn)
	if err != nil {
		return failure(stderr, command, err, dsn)
	}
	if !slices.ContainsFunc(recorded, func(r store.RecordedTopic) bool { return r.Topic == topic }) {
		names := make([]string, len(recorded))
		for i, r := range recorded {
			names[i] = r.Topic
		}
		listed := "none yet"
		if len(names) > 0 {
			listed = strings.Join(names, ", ")
		}
		return fail("topic %s has no partition count recorded in %s: the relay never published to it, so there is nothing to adopt (its first record will record the topic's count then). "+
			"Check --event-topic and --table; the topics the relay published to (outbox-relay partitions show): %s", topic, registry.Table(), listed)
	}
	actual, err := publisher.TopicPartitionCount(client, topic)
	if err != nil {
		return fail("%s; check --event-topic (outbox-relay partitions show lists the topics the relay publishes to)", operatorMessage(err, dsn))
	}
	n := actual
	if o.adopt.partitions > 0 {
		n = int32(o.adopt.partitions)
	}
	if n > actual {
		return fail("--partitions %d: topic %s has %d partitions; keys can only be mapped by at most that many", n, topic, actual)
	}
	slots := store.SlotRegistry(registry.Table()).Quoted()
	running, err := pg.RunningRelay(ctx, conn, o.relay.Replication.Config, o.relay.Replication.Slot, slots)
	if err != nil {
		return failure(stderr, command, err, dsn)
	}
	if len(running) > 0 {
		return fail("%s. Every relay on the tables of schema %s maps keys by %s. Stop it first, each one listed, standbys included (systemctl stop outbox-relay, or every instance of it): events wait in PostgreSQL meanwhile. "+
			"A relay that keeps publishing keeps consumers from reaching the end, and maps keys by the old count until it restarts. Then run this command again; see %s",
			strings.Join(running, "; "), registry.Table().Schema, registry.Table(), publisher.PartitionsDoc)
	}
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return failure(stderr, command, fmt.Errorf("kafka admin: %w", err), dsn)
	}
	groups := groupList(o.adopt.groups)
	behind, err := publisher.GroupsBehind(client, admin, topic, groups)
	if err != nil {
		return fail("%s; check --consumer-groups, and that the relay's Kafka principal may describe the groups and read the topic", operatorMessage(err, dsn))
	}
	if len(behind) > 0 {
		var lines []string
		for _, b := range behind {
			committed := "nothing committed"
			if b.Committed >= 0 {
				committed = fmt.Sprintf("committed %d", b.Committed)
			}
			lines = append(lines, fmt.Sprintf("%s on %s/%d: %s, end %d (%d behind)", b.Group, topic, b.Partition, committed, b.End, b.End-max(b.Committed, 0)))
			if len(lines) == 10 {
				lines = append(lines, fmt.Sprintf("and %d more", len(behind)-10))
				break
			}
		}
		return fail("%d partition(s) not read to the end by the named consumer groups: %s. Adopting now would let a consumer read an aggregate's newer events, on its new partition, before its older ones. "+
			"Keep the relay stopped, wait until the groups caught up, and run this command again; "+
			"a group that no longer reads the topic: leave it out of --consumer-groups, or delete it", len(behind), strings.Join(lines, "; "))
	}

	tx, err := conn.Begin(ctx)
	if err != nil {
		return failure(stderr, command, fmt.Errorf("begin: %w", err), dsn)
	}
	defer tx.Rollback(context.Background())
	prev, err := registry.Adopt(ctx, tx, topic, n)
	if err != nil {
		return failure(stderr, command, err, dsn)
	}
	// Again, with the row held: a relay that started since the first check
	// is refused here, and one that starts after it waits for this
	// transaction and reads the new count.
	if running, err = pg.RunningRelay(ctx, tx, o.relay.Replication.Config, o.relay.Replication.Slot, slots); err != nil {
		return failure(stderr, command, err, dsn)
	}
	if len(running) > 0 {
		return fail("%s: it started while this command ran, and nothing was recorded. Stop it, and run this command again", strings.Join(running, "; "))
	}
	if err := tx.Commit(ctx); err != nil {
		return failure(stderr, command, fmt.Errorf("commit: %w", err), dsn)
	}
	was := "nothing recorded"
	if prev > 0 {
		was = fmt.Sprintf("was %d", prev)
	}
	fmt.Fprintf(stdout, "topic %s: keys are mapped by %d partitions from the relay's next start (%s); the consumer groups %s had read every partition to its end. Start the relay now.\n",
		topic, n, was, strings.Join(groups, ", "))
	return exitOK
}
