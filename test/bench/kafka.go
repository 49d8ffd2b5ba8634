package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// broker is one Kafka the relay publishes to.
type broker struct {
	name   string // kfake or apache
	addrs  []string
	adm    *kadm.Client
	cl     *kgo.Client
	apache *harness.ApacheKafka
	kfake  *kfakeProcess
}

func (br *broker) list() string { return strings.Join(br.addrs, ",") }

// cpuSeconds is the broker's CPU so far: the JVMs' for Apache Kafka, the
// kfake child process's for kfake.
func (br *broker) cpuSeconds() float64 {
	var pids []int
	switch {
	case br.apache != nil:
		pids = br.apache.PIDs()
	case br.kfake != nil:
		pids = []int{br.kfake.pid()}
	}
	total := 0.0
	for _, pid := range pids {
		if s, err := cpuSeconds(pid); err == nil {
			total += s
		}
	}
	return total
}

func (b *bench) startBrokers() error {
	want := b.o.broker
	var apache *harness.ApacheKafka
	var apacheErr error
	if want != "kfake" {
		b.logf("starting Apache Kafka %s (single node, KRaft)", harness.ApacheKafka4Version)
		apache, apacheErr = harness.StartApacheKafka(harness.ApacheKafkaOptions{
			NumPartitions: b.o.partitions, AutoCreateTopics: true, HeapMB: 512, ServerJVM: b.o.apacheJVM == "server",
		})
		if apacheErr != nil {
			if want == "apache" || want == "both" || !errors.Is(apacheErr, harness.ErrApacheKafkaUnavailable) {
				return fmt.Errorf("apache kafka: %w", apacheErr)
			}
			msg := fmt.Sprintf("Apache Kafka is NOT available here, so only kfake was measured: %v (run `make kafka`, which needs Maven and Java 17+)", apacheErr)
			b.logf("%s", msg)
			b.res.Problems = append(b.res.Problems, msg)
		} else {
			b.defer_(apache.Close)
		}
	}
	if want != "apache" {
		kp, err := startKfakeProcess(b.o.partitions)
		if err != nil {
			return fmt.Errorf("start kfake: %w", err)
		}
		b.defer_(kp.close)
		br, err := newBroker("kfake", kp.addrs)
		if err != nil {
			return err
		}
		br.kfake = kp
		b.defer_(br.cl.Close)
		b.brokers = append(b.brokers, br)
	}
	if apache != nil {
		br, err := newBroker("apache", apache.Brokers())
		if err != nil {
			return err
		}
		br.apache = apache
		b.defer_(br.cl.Close)
		b.brokers = append(b.brokers, br)
	}
	return nil
}

func newBroker(name string, addrs []string) (*broker, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.RetryTimeout(30*time.Second))
	if err != nil {
		return nil, fmt.Errorf("%s client: %w", name, err)
	}
	return &broker{name: name, addrs: addrs, cl: cl, adm: kadm.NewClient(cl)}, nil
}

// createTopic creates a fresh topic for one run, so its end offsets count
// exactly the records that run produced.
func (br *broker) createTopic(name string, partitions int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if br.apache != nil {
		return br.apache.CreateTopic(name, int32(partitions), 1, nil)
	}
	resp, err := br.adm.CreateTopic(ctx, int32(partitions), 1, nil, name)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		return fmt.Errorf("create topic %s on %s: %w", name, br.name, err)
	}
	return nil
}

// acked returns the number of records the topic holds: the sum of its end
// offsets (records are acknowledged once appended; the replication factor
// is 1).
func (br *broker) acked(ctx context.Context, topic string) (int64, error) {
	return sumListed(ctx, br.adm.ListEndOffsets, topic)
}

// committed returns the number of records of the topic a read_committed
// reader may see: the sum of its last stable offsets. Records of an open
// Kafka transaction lie beyond it.
func (br *broker) committed(ctx context.Context, topic string) (int64, error) {
	return sumListed(ctx, br.adm.ListCommittedOffsets, topic)
}

// sumListed sums the offsets list gives for the topic's partitions.
func sumListed(ctx context.Context, list func(context.Context, ...string) (kadm.ListedOffsets, error), topic string) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	offs, err := list(ctx, topic)
	if err != nil {
		return 0, err
	}
	var n int64
	var ferr error
	offs.Each(func(o kadm.ListedOffset) {
		if o.Err != nil {
			ferr = o.Err
		}
		n += o.Offset
	})
	return n, ferr
}
