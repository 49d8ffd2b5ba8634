package harness

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/outbox-relay/outbox-relay/internal/throwaway"
)

// KfakeOptions configures StartKfakeWith: brokers, partitions,
// auto-creation, topics made at start, and further kfake options.
type KfakeOptions = throwaway.KfakeOptions

// Kfake is an in-process Kafka cluster (franz-go's kfake) on 127.0.0.1.
//
// Besides the fault helpers below, Cluster() gives the raw cluster for
// anything else: ControlKey(key, fn) intercepts requests of one kind
// (kmsg.Produce, kmsg.Metadata, ...) on kfake's single request loop. fn
// returning handled=true answers the request with fn's response, or closes
// the connection if fn returns an error; the control is then dropped unless
// fn called KeepControl. handled=false passes the request on to later
// controls and then to normal processing, and keeps the control unless fn
// called DropControl. fn must not block: it stalls the whole cluster. To
// delay a request use SleepControl(wakeup) inside fn, which parks that
// request (and later requests on the same connection, whose responses must
// stay in order) while the cluster serves everything else.
type Kfake struct {
	c       *kfake.Cluster
	brokers []string

	held     atomic.Int64
	mu       sync.Mutex
	releases []func()
}

// StartKfake starts a cluster with one broker and topic auto-creation on;
// opts are applied after those defaults, so kfake.NumBrokers(3) or
// kfake.DefaultNumPartitions(4) override them. Auto-creation cannot be
// turned off this way; use StartKfakeWith. The cluster is closed when the
// test ends.
func StartKfake(t testing.TB, opts ...kfake.Opt) *Kfake {
	t.Helper()
	return StartKfakeWith(t, KfakeOptions{Extra: opts})
}

// StartKfakeWith starts a cluster configured by o; see StartKfake.
func StartKfakeWith(t testing.TB, o KfakeOptions) *Kfake {
	t.Helper()
	c, err := throwaway.StartKfake(o)
	if err != nil {
		t.Fatal(err)
	}
	k := &Kfake{c: c, brokers: c.ListenAddrs()}
	t.Cleanup(k.close)
	return k
}

// close releases held produce requests before closing the cluster: a
// request still sleeping at Close leaves kfake's control goroutines
// blocked forever.
func (k *Kfake) close() {
	k.mu.Lock()
	releases := k.releases
	k.releases = nil
	k.mu.Unlock()
	for _, r := range releases {
		r()
	}
	k.c.Close()
}

// Brokers are the brokers' host:port addresses.
func (k *Kfake) Brokers() []string { return append([]string(nil), k.brokers...) }

// BrokerList is Brokers joined with commas, as most configs want it.
func (k *Kfake) BrokerList() string { return strings.Join(k.brokers, ",") }

// Cluster is the underlying kfake cluster, for ControlKey and the like.
func (k *Kfake) Cluster() *kfake.Cluster { return k.c }

// CreateTopic creates a topic through the Kafka protocol, failing the test
// on error; configs are topic configs such as max.message.bytes.
func (k *Kfake) CreateTopic(t testing.TB, name string, partitions int32, configs map[string]string) {
	t.Helper()
	CreateTopic(t, k.brokers, name, partitions, configs)
}

// SetTopicConfig sets one config of a topic, such as max.message.bytes to
// let a refused record through, and fails the test if the cluster refuses.
func (k *Kfake) SetTopicConfig(t testing.TB, topic, name, value string) {
	t.Helper()
	resp, err := kadm.NewClient(k.Client(t)).AlterTopicConfigs(context.Background(),
		[]kadm.AlterConfig{{Name: name, Value: &value}}, topic)
	if err == nil {
		_, err = resp.On(topic, nil)
	}
	if err != nil {
		t.Fatalf("set %s of topic %s: %v", name, topic, err)
	}
}

// Client returns a franz-go client for this cluster, closed when the test
// ends. Unlike a bare franz-go client it asks for topic auto-creation, as
// sarama does, so producing to a new topic works when the cluster allows it.
func (k *Kfake) Client(t testing.TB, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	return NewKgoClient(t, k.brokers, append([]kgo.Opt{kgo.AllowAutoTopicCreation()}, opts...)...)
}

// ProduceFault is a handle on a fault injected into produce requests.
type ProduceFault struct {
	hits   func() int
	remove func()
}

// Hits is how many produce requests the fault has answered so far.
func (f *ProduceFault) Hits() int { return f.hits() }

// Remove stops the fault from answering further requests.
func (f *ProduceFault) Remove() { f.remove() }

// FailProduce answers the next times produce requests (times < 0: every one
// until Remove) with errCode for every partition in them, without appending
// anything, like a broker rejecting the request. Retriable codes (e.g.
// kerr.NotLeaderForPartition.Code) make clients retry; others
// (kerr.InvalidRecord.Code) fail the records. acks=0 requests, which get
// no response, are let through.
//
// This uses ControlKey, so it takes precedence over kfake's Cluster.Fault
// faults, and counts requests, not partitions or records.
func (k *Kfake) FailProduce(times int, errCode int16) *ProduceFault {
	msg := "injected by test harness"
	if e := kerr.ErrorForCode(errCode); e != nil {
		msg = e.Error() + " (" + msg + ")"
	}
	return k.controlProduce(times, func(req *kmsg.ProduceRequest) (kmsg.Response, error) {
		return produceErrorResponse(req, errCode, msg), nil
	})
}

// FailProduceTo is FailProduce for produce requests that carry records of
// a topic whose name starts with prefix; other produce requests pass and
// are not counted. A fault meant for the relay's event producer then
// cannot land on its progress writer instead.
func (k *Kfake) FailProduceTo(prefix string, times int, errCode int16) *ProduceFault {
	msg := "injected by test harness"
	if e := kerr.ErrorForCode(errCode); e != nil {
		msg = e.Error() + " (" + msg + ")"
	}
	toPrefix := func(req kmsg.Request) bool {
		for _, t := range req.(*kmsg.ProduceRequest).Topics {
			if strings.HasPrefix(t.Topic, prefix) {
				return true
			}
		}
		return false
	}
	return k.controlMatching(kmsg.Produce, times, toPrefix, func(req kmsg.Request) (kmsg.Response, error) {
		return produceErrorResponse(req.(*kmsg.ProduceRequest), errCode, msg), nil
	})
}

// CutProduce closes the connection on the next times produce requests
// (times < 0: every one until Remove) instead of answering them. The
// records are not appended; the client sees a broken connection with the
// request in flight.
func (k *Kfake) CutProduce(times int) *ProduceFault {
	return k.controlProduce(times, func(*kmsg.ProduceRequest) (kmsg.Response, error) {
		return nil, errors.New("connection cut by test harness")
	})
}

// controlProduce installs one ControlKey function that answers produce
// requests with answer until it has answered times of them. One function
// with KeepControl, rather than times functions, lets Remove take effect at
// once.
func (k *Kfake) controlProduce(times int, answer func(*kmsg.ProduceRequest) (kmsg.Response, error)) *ProduceFault {
	return k.controlRequests(kmsg.Produce, times, func(req kmsg.Request) (kmsg.Response, error) {
		return answer(req.(*kmsg.ProduceRequest))
	})
}

// FailProduceAfterAppend appends the next times produce requests (times <
// 0: every one until Remove) normally but answers them with
// REQUEST_TIMED_OUT, as a broker does when replication times out after the
// leader wrote the batch. A client that retries without idempotence then
// writes duplicates; an idempotent one is deduplicated by kfake.
//
// This uses kfake's Cluster.Fault, the only way to fail a request after
// kfake applied it; a ControlKey answer would bypass it.
func (k *Kfake) FailProduceAfterAppend(times int) *ProduceFault {
	count := times
	if times < 0 {
		count = -1
	}
	if times == 0 {
		return &ProduceFault{hits: func() int { return 0 }, remove: func() {}}
	}
	h := k.c.Fault(kfake.Fault{
		Keys:  []kmsg.Key{kmsg.Produce},
		Err:   kerr.RequestTimedOut,
		Count: count,
	})
	return &ProduceFault{hits: h.Hits, remove: h.Remove}
}

// HoldProduce parks every produce request that arrives from now on, before
// kfake appends it, until release is called; then the parked requests are
// appended and answered in order and later ones pass straight through. The
// client sees a broker that stopped responding to produce: other requests
// on other connections (franz-go's metadata, a consumer's fetches) are
// still served, but because responses on one connection must stay in order,
// a client that multiplexes everything over one connection per broker
// (sarama does) sees those stall too.
//
// release may be called any number of times; the cluster releases holds
// itself before closing, so a test may also never call it.
// HeldProduces reports how many requests are parked.
func (k *Kfake) HoldProduce() (release func()) {
	return k.HoldRequests(kmsg.Produce)
}

// DelayProduce answers every produce request that arrives from now on d
// later, as a broker whose acks take d (Apache Kafka's take tens of
// milliseconds here; kfake's well under one), until remove is called. A
// client then has records in flight most of the time, as against a real
// broker; it is a latency injected, not a wait.
func (k *Kfake) DelayProduce(d time.Duration) (remove func()) {
	var removed atomic.Bool
	k.c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		if removed.Load() {
			k.c.DropControl()
			return nil, nil, false
		}
		k.c.SleepControl(func() { time.Sleep(d) })
		return nil, nil, false
	})
	return func() { removed.Store(true) }
}

// HeldProduces is the number of produce requests HoldProduce is parking.
func (k *Kfake) HeldProduces() int { return int(k.held.Load()) }

// produceErrorResponse answers every partition of req with code, as a
// broker that rejected the whole request would.
func produceErrorResponse(req *kmsg.ProduceRequest, code int16, msg string) kmsg.Response {
	resp := req.ResponseKind().(*kmsg.ProduceResponse)
	for _, rt := range req.Topics {
		st := kmsg.NewProduceResponseTopic()
		st.Topic = rt.Topic
		st.TopicID = rt.TopicID
		for _, rp := range rt.Partitions {
			sp := kmsg.NewProduceResponseTopicPartition()
			sp.Partition = rp.Partition
			sp.ErrorCode = code
			sp.BaseOffset = -1
			if req.Version >= 8 {
				m := msg
				sp.ErrorMessage = &m
			}
			st.Partitions = append(st.Partitions, sp)
		}
		resp.Topics = append(resp.Topics, st)
	}
	return resp
}
