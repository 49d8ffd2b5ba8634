package kafkaread

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

func startKfake(t *testing.T) []string {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c.ListenAddrs()
}

func saramaClient(t *testing.T, brokers []string) sarama.Client {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	cl, err := sarama.NewClient(brokers, sc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func produce(t *testing.T, cl *kgo.Client, values ...string) {
	t.Helper()
	for _, v := range values {
		if err := cl.ProduceSync(context.Background(), &kgo.Record{Topic: "t", Value: []byte(v)}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
}

func readAll(p Partition, end int64) ([]string, error) {
	var got []string
	err := p.Read(context.Background(), 0, end, func(r Record) { got = append(got, string(r.Value)) })
	return got, err
}

// A partition written with transactions: markers are stepped over, aborted
// records are dropped, and a read whose end lies past a transaction still
// open waits for it within Stall and fails after it, never handing over a
// record that may yet abort. sarama's consumer hides the markers, so a
// reader built on it waited for the last offset forever.
func TestReadStepsOverMarkersAndAbortedRecords(t *testing.T) {
	brokers := startKfake(t)
	plain, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	txn, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.TransactionalID("kafkaread-test"))
	if err != nil {
		t.Fatal(err)
	}
	defer txn.Close()
	ctx := context.Background()
	inTxn := func(end kgo.TransactionEndTry, values ...string) {
		t.Helper()
		if err := txn.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		produce(t, txn, values...)
		if err := txn.EndTransaction(ctx, end); err != nil {
			t.Fatal(err)
		}
	}
	produce(t, plain, "a")
	inTxn(kgo.TryCommit, "b", "c")
	inTxn(kgo.TryAbort, "aborted-1", "aborted-2")
	inTxn(kgo.TryCommit, "d")

	cl := saramaClient(t, brokers)
	hwm, err := cl.GetOffset("t", 0, sarama.OffsetNewest)
	if err != nil {
		t.Fatal(err)
	}
	p := Partition{Client: cl, Topic: "t", Partition: 0, Stall: 10 * time.Second}
	for _, end := range []int64{hwm, StableEnd} {
		got, err := readAll(p, end)
		if err != nil || strings.Join(got, ",") != "a,b,c,d" {
			t.Fatalf("read to %d: %v, %v; want a,b,c,d", end, got, err)
		}
	}

	// A transaction open at the end.
	if err := txn.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	produce(t, txn, "open")
	if err := txn.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	past, err := cl.GetOffset("t", 0, sarama.OffsetNewest)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := readAll(p, StableEnd); err != nil || strings.Join(got, ",") != "a,b,c,d" {
		t.Fatalf("read to the stable end with a transaction open: %v, %v; want a,b,c,d", got, err)
	}
	impatient := p
	impatient.Stall = 300 * time.Millisecond
	if got, err := readAll(impatient, past); err == nil || !strings.Contains(err.Error(), "nothing readable") {
		t.Fatalf("read past an open transaction: %v, %v; want it to give up after the stall", got, err)
	}
	done := make(chan error, 1)
	var got []string
	go func() {
		var err error
		got, err = readAll(p, past)
		done <- err
	}()
	if err := txn.EndTransaction(ctx, kgo.TryCommit); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || strings.Join(got, ",") != "a,b,c,d,open" {
		t.Fatalf("read past a transaction that then committed: %v, %v; want a,b,c,d,open", got, err)
	}
}
