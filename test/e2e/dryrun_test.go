package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/outbox-relay/outbox-relay/messages"
	"github.com/outbox-relay/outbox-relay/test/harness"
)

// printedRecord is a line of `run --dry-run`, read independently of the
// relay's own types.
type printedRecord struct {
	Topic          string `json:"topic"`
	Partition      *int32 `json:"partition"`
	PartitionError string `json:"partition_error"`
	EventID        string `json:"event_id"`
	Key            string `json:"key"`
	Value          string `json:"value"`
	Headers        []struct {
		Key   string `json:"key"`
		Value string `json:"value"`
	} `json:"headers"`
	Quarantined bool   `json:"quarantined"`
	Error       string `json:"error"`
}

func printedRecords(t *testing.T, stdout string) []printedRecord {
	t.Helper()
	var out []printedRecord
	for _, line := range strings.Split(strings.TrimSpace(stdout), "\n") {
		if line == "" {
			continue
		}
		var r printedRecord
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("stdout line is not a record: %q: %v", line, err)
		}
		out = append(out, r)
	}
	return out
}

// Issue 41.3: `run --dry-run` prints each record (topic, partition, key,
// headers, value) as a JSON line on stdout, for every source, and writes
// nothing anywhere: the configured slot is never held or moved (and no
// temporary slot outlives the run), no poll row is claimed or marked, no
// quarantine row is written, and Kafka gets no record and no topic.
func TestDryRunPrintsRecordsAndWritesNothing(t *testing.T) {
	for _, source := range []string{"wal", "messages", "poll", "poll-snapshot"} {
		t.Run(source, func(t *testing.T) { testDryRun(t, source) })
	}
}

func testDryRun(t *testing.T, source string) {
	e := newEnv(t)
	ctx := context.Background()
	slot := e.Slot
	topicPrefix := "outbox.event."
	var args []string
	switch source {
	case "wal":
		e.Migrate()
		e.DB.DropSlotAtEnd(t, slot)
		args = e.Args("run", "--dry-run")
	case "messages":
		slot += messagesSlotSuffix
		topicPrefix = messagesTopicPrefix
		harness.Migrate(t, e.Bin, e.messagesArgs("migrate"))
		e.DB.DropSlotAtEnd(t, slot)
		e.Ledger.EmitMessages(t, e.DB, messages.DefaultPrefix)
		args = e.messagesArgs("run", "--dry-run")
	case "poll":
		e.Source = "poll"
		e.Migrate()
		slot = ""
		args = e.Args("run", "--dry-run")
	case "poll-snapshot":
		e.Source = "poll"
		e.Migrate("--poll-strategy", "snapshot")
		slot = ""
		args = e.Args("run", "--dry-run", "--poll-strategy", "snapshot")
	}
	// One topic exists, so its records name their partition; the others
	// do not, and the dry run must not create them.
	withPartitions := topicPrefix + "order"
	e.Kafka.CreateTopic(t, withPartitions, partitions, nil)
	before := harness.SlotInfo{}
	if slot != "" {
		before = cluster.SlotInfo(t, e.DB.Name(), slot)
		if !before.Exists {
			t.Fatalf("migrate made no slot %s", slot)
		}
	}
	conn := e.DB.Connect(t)
	payload := func(n, agg int) string { return fmt.Sprintf(`{"n": %d, "agg": %d}`, n, agg) }
	polls := strings.HasPrefix(source, "poll")
	progressBefore := ""
	if polls {
		// Rows pending before the dry run starts are printed too.
		if err := e.WriteNumbered(conn, 0, 4, 3, 5, payload); err != nil {
			t.Fatal(err)
		}
	}

	dry := harness.StartProcessSplit(t, e.Bin, args, []string{harness.LogLevelInfo})
	dry.WaitForOutput(t, "dry run: printing", time.Minute)
	first := 0
	if polls {
		first = 12
	}
	if source == "poll-snapshot" {
		progressBefore = e.DB.QueryString(t, "SELECT row(s.*)::text FROM outbox_events_poll_snapshot s")
	}
	if err := e.WriteNumbered(conn, first, 6, 3, 5, payload); err != nil {
		t.Fatal(err)
	}
	if source == "messages" {
		// A message that is no event is printed as quarantined, and
		// written nowhere.
		e.DB.Exec(t, "SELECT pg_logical_emit_message(true, $1, 'not json')", messages.DefaultPrefix)
	}
	ids, _ := e.Committed()
	want := len(ids)
	if source == "messages" {
		want++
	}
	harness.WaitFor(t, time.Minute, "every event printed", func() bool {
		return strings.Count(dry.Stdout(), "\n") >= want || dry.Exited()
	})
	if slot != "" {
		during := cluster.SlotInfo(t, e.DB.Name(), slot)
		if during.Active {
			t.Errorf("the dry run holds the configured slot %s", slot)
		}
	}
	if err := dry.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code, err := dry.Wait(30 * time.Second); err != nil || code != 0 {
		t.Fatalf("the dry run exited %d (%v) on SIGTERM; logs:\n%s", code, err, harness.LastLines(dry.Output(), 20))
	}

	// A refused event is printed by the quarantine's path, which does not
	// wait for the records before it: its line may come first.
	var printed, refused []printedRecord
	for _, r := range printedRecords(t, dry.Stdout()) {
		if r.Quarantined {
			refused = append(refused, r)
		} else {
			printed = append(printed, r)
		}
	}
	if len(printed)+len(refused) != want || len(printed) != len(ids) {
		t.Fatalf("%d records and %d refused events printed, want %d records of %d lines:\n%s", len(printed), len(refused), len(ids), want, dry.Stdout())
	}
	for i, id := range ids {
		r := printed[i]
		n := first + i
		if polls {
			n = i
		}
		ev := harness.NumberedEvent(n, n%5, payload(n, n%5))
		if r.EventID != id || r.Topic != topicPrefix+ev.AggregateType || r.Key != ev.AggregateID || r.Value != ev.Payload {
			t.Fatalf("line %d is %+v, want event %s of aggregate %s, topic %s%s, value %s", i, r, id, ev.AggregateID, topicPrefix, ev.AggregateType, ev.Payload)
		}
		hasID := false
		for _, h := range r.Headers {
			hasID = hasID || h.Key == "event_id" && h.Value == id
		}
		if !hasID {
			t.Errorf("line %d has no event_id header %s: %+v", i, id, r.Headers)
		}
		switch {
		case r.Topic == withPartitions && (r.Partition == nil || *r.Partition != harness.JavaPartition([]byte(r.Key), partitions)):
			t.Errorf("line %d: partition %v, want %d", i, r.Partition, harness.JavaPartition([]byte(r.Key), partitions))
		case r.Topic != withPartitions && (r.Partition != nil || !strings.Contains(r.PartitionError, r.Topic)):
			t.Errorf("line %d: topic %s does not exist, yet partition %v, error %q", i, r.Topic, r.Partition, r.PartitionError)
		}
	}
	if source == "messages" && !strings.Contains(refused[0].Error, "not valid JSON") {
		t.Errorf("the bad message printed as %+v, want quarantined as not JSON", refused[0])
	}

	// Nothing written: the slot where it was, no slot of the dry run's
	// left, no poll row touched, no quarantine row, no record or topic.
	if slot != "" {
		after := cluster.SlotInfo(t, e.DB.Name(), slot)
		if after.ConfirmedFlush != before.ConfirmedFlush || after.RestartLSN != before.RestartLSN {
			t.Errorf("the configured slot moved: confirmed %s -> %s, restart %s -> %s",
				before.ConfirmedFlush, after.ConfirmedFlush, before.RestartLSN, after.RestartLSN)
		}
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE '%dry_run%'"); n != 0 {
		t.Errorf("%d dry-run slots outlived the run", n)
	}
	if source == "poll" {
		if n := e.DB.QueryInt64(t, `SELECT count(*) FROM outbox_events_poll
			WHERE published_at IS NOT NULL OR lease_holder IS NOT NULL OR attempts > 0 OR quarantined_at IS NOT NULL`); n != 0 {
			t.Errorf("%d poll state rows were claimed or marked", n)
		}
	}
	if source == "poll-snapshot" {
		if after := e.DB.QueryString(t, "SELECT row(s.*)::text FROM outbox_events_poll_snapshot s"); after != progressBefore {
			t.Errorf("the snapshot strategy's progress row changed from %s to %s", progressBefore, after)
		}
	}
	if n := e.DB.QueryInt64(t, "SELECT count(*) FROM outbox_quarantine"); n != 0 {
		t.Errorf("%d quarantine rows written", n)
	}
	adm := kadm.NewClient(e.Kafka.Client(t))
	topics, err := adm.ListTopics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if names := topics.Names(); len(names) != 1 || names[0] != withPartitions {
		t.Errorf("topics after the dry run: %v, want only %s, made before it", names, withPartitions)
	}
	ends, err := adm.ListEndOffsets(ctx, withPartitions)
	if err != nil {
		t.Fatal(err)
	}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset != 0 {
			t.Errorf("%s/%d holds %d records", o.Topic, o.Partition, o.Offset)
		}
	})
}
