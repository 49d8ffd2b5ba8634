package harness

// Kafka transactions: what read_committed consumers may read (the last
// stable offsets), and fault injection on kfake: hold, fail or cut the
// transaction coordinator's requests (AddPartitionsToTxn, EndTxn, ...), and
// refuse produce requests that carry a given record, the way a broker
// refuses one poison record.

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// HoldRequests parks every request of kind key that arrives from now on,
// before kfake processes it, until release is called; then the parked
// requests are processed in order and later ones pass straight through.
// HoldProduce is this for produce requests; holding EndTxn keeps a
// transaction's commit pending, which is how a test sees what consumers see
// between the last record and the commit.
func (k *Kfake) HoldRequests(key kmsg.Key) (release func()) {
	ch := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	k.mu.Lock()
	k.releases = append(k.releases, release)
	k.mu.Unlock()
	k.c.ControlKey(int16(key), func(kmsg.Request) (kmsg.Response, error, bool) {
		select {
		case <-ch:
			k.c.DropControl()
			return nil, nil, false
		default:
		}
		k.held.Add(1)
		k.c.SleepControl(func() { <-ch })
		k.held.Add(-1)
		return nil, nil, false
	})
	return release
}

// HeldRequests is the number of requests HoldProduce and HoldRequests are
// parking.
func (k *Kfake) HeldRequests() int { return int(k.held.Load()) }

// FailTxnRequests answers the next times requests of kind key (times < 0:
// every one until Remove) with errCode, without processing them. It knows
// the transaction coordinator's requests: AddPartitionsToTxn (every
// partition gets the code), EndTxn and InitProducerID.
func (k *Kfake) FailTxnRequests(key kmsg.Key, times int, errCode int16) *ProduceFault {
	return k.controlRequests(key, times, func(req kmsg.Request) (kmsg.Response, error) {
		switch req := req.(type) {
		case *kmsg.AddPartitionsToTxnRequest:
			resp := req.ResponseKind().(*kmsg.AddPartitionsToTxnResponse)
			for _, rt := range req.Topics {
				st := kmsg.NewAddPartitionsToTxnResponseTopic()
				st.Topic = rt.Topic
				for _, p := range rt.Partitions {
					sp := kmsg.NewAddPartitionsToTxnResponseTopicPartition()
					sp.Partition = p
					sp.ErrorCode = errCode
					st.Partitions = append(st.Partitions, sp)
				}
				resp.Topics = append(resp.Topics, st)
			}
			return resp, nil
		case *kmsg.EndTxnRequest:
			resp := req.ResponseKind().(*kmsg.EndTxnResponse)
			resp.ErrorCode = errCode
			return resp, nil
		case *kmsg.InitProducerIDRequest:
			resp := req.ResponseKind().(*kmsg.InitProducerIDResponse)
			resp.ErrorCode = errCode
			resp.ProducerID, resp.ProducerEpoch = -1, -1
			return resp, nil
		}
		return nil, errors.New("harness: FailTxnRequests does not know this request kind")
	})
}

// CutRequests closes the connection on the next times requests of kind
// key (times < 0: every one until Remove) instead of answering them; the
// request is not processed.
func (k *Kfake) CutRequests(key kmsg.Key, times int) *ProduceFault {
	return k.controlRequests(key, times, func(kmsg.Request) (kmsg.Response, error) {
		return nil, errors.New("connection cut by test harness")
	})
}

// RefuseRecordsWith answers every produce request whose records contain
// marker (an event id, say) with errCode for all its partitions, until
// Remove, appending nothing: the broker refusing one poison record, which
// fails the whole request. Records must be sent uncompressed for the
// marker to be found.
func (k *Kfake) RefuseRecordsWith(marker []byte, errCode int16) *ProduceFault {
	msg := "refused by test harness"
	if e := kerr.ErrorForCode(errCode); e != nil {
		msg = e.Error() + " (" + msg + ")"
	}
	var hits atomic.Int64
	var removed atomic.Bool
	k.c.ControlKey(int16(kmsg.Produce), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		if removed.Load() {
			k.c.DropControl()
			return nil, nil, false
		}
		k.c.KeepControl()
		req := kreq.(*kmsg.ProduceRequest)
		for _, t := range req.Topics {
			for _, p := range t.Partitions {
				if bytes.Contains(p.Records, marker) {
					hits.Add(1)
					return produceErrorResponse(req, errCode, msg), nil, true
				}
			}
		}
		return nil, nil, false
	})
	return &ProduceFault{hits: func() int { return int(hits.Load()) }, remove: func() { removed.Store(true) }}
}

// controlRequests installs one ControlKey function that answers requests
// of kind key with answer until it has answered times of them. One
// function with KeepControl, rather than times functions, lets Remove take
// effect at once. acks=0 produce requests pass untouched.
func (k *Kfake) controlRequests(key kmsg.Key, times int, answer func(kmsg.Request) (kmsg.Response, error)) *ProduceFault {
	return k.controlMatching(key, times, nil, answer)
}

// controlMatching is controlRequests for the requests match accepts (all
// when match is nil); the others pass untouched and are not counted.
func (k *Kfake) controlMatching(key kmsg.Key, times int, match func(kmsg.Request) bool, answer func(kmsg.Request) (kmsg.Response, error)) *ProduceFault {
	var hits atomic.Int64
	var removed atomic.Bool
	f := &ProduceFault{
		hits:   func() int { return int(hits.Load()) },
		remove: func() { removed.Store(true) },
	}
	if times == 0 {
		return f
	}
	k.c.ControlKey(int16(key), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if removed.Load() {
			k.c.DropControl()
			return nil, nil, false
		}
		if produce, ok := req.(*kmsg.ProduceRequest); ok && produce.Acks == 0 {
			return nil, nil, false // no response is expected, so none can fail
		}
		if match != nil && !match(req) {
			k.c.KeepControl()
			return nil, nil, false
		}
		n := hits.Add(1)
		if times < 0 || n < int64(times) {
			k.c.KeepControl()
		} else {
			// KeepControl is sticky once called; only DropControl
			// removes the function after this last answer.
			k.c.DropControl()
		}
		resp, err := answer(req)
		return resp, err, true
	})
	return f
}

// StableOffsets returns the last stable offset of every partition of
// topic: how far a read_committed consumer may read. Records of an open
// transaction lie beyond it; EndOffsets (the high watermark) counts them.
func StableOffsets(t testing.TB, brokers []string, topic string) map[int32]int64 {
	t.Helper()
	adm, closeAdm := adminClient(t, brokers)
	defer closeAdm()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	listed, err := adm.ListCommittedOffsets(ctx, topic)
	if err == nil {
		err = listed.Error()
	}
	if err != nil {
		t.Fatalf("stable offsets of %s: %v", topic, err)
	}
	out := make(map[int32]int64)
	listed.Each(func(o kadm.ListedOffset) { out[o.Partition] = o.Offset })
	return out
}

// ConsumeExactlyOnce is ConsumeEventIDs with read_committed, then fails
// the test for every wanted event seen more than once and every event seen
// that was not wanted: what an exactly-once producer must leave visible.
func ConsumeExactlyOnce(t testing.TB, brokers []string, topicRegex string, want []string, timeout time.Duration) []Record {
	t.Helper()
	records := ConsumeEventIDs(t, brokers, topicRegex, want, timeout)
	wanted := make(map[string]bool, len(want))
	for _, id := range want {
		wanted[id] = true
	}
	for id, n := range Duplicates(records) {
		t.Errorf("event %s visible %d times to read_committed", id, n)
	}
	for _, r := range records {
		if !wanted[r.EventID()] {
			t.Errorf("event %s visible to read_committed at %s, but it was never committed", r.EventID(), r.pos())
		}
	}
	return records
}
