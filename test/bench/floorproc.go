package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
)

// childFloor is the first argument that makes the bench binary a bare
// producer: it sends records on an open-loop schedule with sarama (the
// relay's producer settings, none of the relay's code) or franz-go, so the
// steady-rate part can set each client's own CPU per record and latency next
// to the relay's, at the same rate and linger.
const childFloor = "child-floor"

// sentHeader carries the wall-clock time a floor record was built, in Unix
// nanoseconds, for the independent consumer to measure latency from.
const sentHeader = "bench_sent_ns"

// floorReport is what the floor child prints when it is done.
type floorReport struct {
	Records    int     `json:"records"` // measured
	Total      int     `json:"total"`   // warm-up included
	CPUSeconds float64 `json:"cpu_seconds"`
	Seconds    float64 `json:"seconds"`
	Error      string  `json:"error,omitempty"`
}

// floorProducer is the part of a Kafka client the floor needs: send one
// record and report its ack (or failure) through onAck.
type floorProducer interface {
	send(key, value []byte, sentNs int64)
	close()
}

type floorArgs struct {
	client      string
	brokers     string
	topic       string
	rate        int
	duration    time.Duration
	warm        time.Duration
	linger      time.Duration
	compression string
	payload     int
	aggregates  int
}

// runFloorChild warms up (one record, then warm at rate), prints
// "measuring <Unix ns>", sends at rate for duration, waits for every ack and prints a
// floorReport as one JSON line.
func runFloorChild(args []string) int {
	var a floorArgs
	fs := flag.NewFlagSet(childFloor, flag.ContinueOnError)
	fs.StringVar(&a.client, "client", "sarama", "sarama or franz-go")
	fs.StringVar(&a.brokers, "brokers", "", "comma-separated brokers")
	fs.StringVar(&a.topic, "topic", "", "topic")
	fs.IntVar(&a.rate, "rate", 2000, "records per second")
	fs.DurationVar(&a.duration, "duration", 15*time.Second, "measured sending time")
	fs.DurationVar(&a.warm, "warm", time.Second, "sending time before the measurement")
	fs.DurationVar(&a.linger, "linger", 0, "producer linger")
	fs.StringVar(&a.compression, "compression", "lz4", "none or lz4")
	fs.IntVar(&a.payload, "payload", 300, "payload bytes")
	fs.IntVar(&a.aggregates, "aggregates", 10000, "distinct keys")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	rep, err := floorRun(a)
	if err != nil {
		rep.Error = err.Error()
	}
	out, _ := json.Marshal(rep)
	fmt.Println(string(out))
	if err != nil {
		return 1
	}
	return 0
}

func floorRun(a floorArgs) (floorReport, error) {
	var rep floorReport
	var acked, failed atomic.Int64
	var firstErr atomic.Value
	onAck := func(err error) {
		if err != nil {
			failed.Add(1)
			firstErr.CompareAndSwap(nil, err.Error())
			return
		}
		acked.Add(1)
	}
	var p floorProducer
	var err error
	switch a.client {
	case "sarama":
		p, err = newSaramaFloor(a, onAck)
	case "franz-go":
		p, err = newFranzFloor(a, onAck)
	default:
		err = fmt.Errorf("unknown client %q", a.client)
	}
	if err != nil {
		return rep, err
	}
	defer p.close()
	pad := max(a.payload-len(payloadJSON(0, 0)), 0)
	seq := 0
	sent := int64(0)
	pace := func(d time.Duration) int {
		start := time.Now()
		n := 0
		for k := 0; ; k++ {
			due := start.Add(time.Duration(float64(k) * float64(time.Second) / float64(a.rate)))
			if !due.Before(start.Add(d)) {
				return n
			}
			if wait := time.Until(due); wait > 0 {
				time.Sleep(wait) // pacing the open-loop schedule
			}
			seq++
			p.send([]byte("agg-"+strconv.Itoa(seq%a.aggregates)), []byte(payloadJSON(seq, pad)), time.Now().UnixNano())
			n++
		}
	}
	waitAcks := func(n int64) error {
		deadline := time.Now().Add(time.Minute)
		for acked.Load() < n {
			if failed.Load() > 0 {
				return fmt.Errorf("produce failed: %v", firstErr.Load())
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%d of %d records acknowledged within a minute", acked.Load(), n)
			}
			time.Sleep(time.Millisecond) // polling the ack count
		}
		return nil
	}
	// One record first: metadata, connections, the producer ID.
	seq++
	p.send([]byte("agg-0"), []byte(payloadJSON(seq, pad)), time.Now().UnixNano())
	sent++
	if err := waitAcks(sent); err != nil {
		return rep, err
	}
	sent += int64(pace(a.warm))
	if err := waitAcks(sent); err != nil {
		return rep, err
	}
	t0 := time.Now()
	fmt.Println("measuring", t0.UnixNano())
	cpu0 := selfCPUSeconds()
	n := pace(a.duration)
	sent += int64(n)
	if err := waitAcks(sent); err != nil {
		return rep, err
	}
	rep.Seconds = time.Since(t0).Seconds()
	rep.CPUSeconds = selfCPUSeconds() - cpu0
	rep.Records, rep.Total = n, int(sent)
	return rep, nil
}

// selfCPUSeconds is this process's user+system CPU time.
func selfCPUSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

// saramaFloor is sarama's AsyncProducer with the producer settings the
// relay uses (idempotent, acks=all, one request in flight per broker).
type saramaFloor struct {
	p     sarama.AsyncProducer
	topic string
	done  chan struct{}
}

func newSaramaFloor(a floorArgs, onAck func(error)) (*saramaFloor, error) {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.ClientID = "bench-floor"
	sc.Producer.Idempotent = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Net.MaxOpenRequests = 1
	sc.Producer.Retry.Max = 10
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	sc.Producer.Partitioner = sarama.NewHashPartitioner
	sc.Producer.Flush.Frequency = a.linger
	if a.compression == "lz4" {
		sc.Producer.Compression = sarama.CompressionLZ4
	}
	p, err := sarama.NewAsyncProducer(strings.Split(a.brokers, ","), sc)
	if err != nil {
		return nil, fmt.Errorf("sarama producer: %w", err)
	}
	f := &saramaFloor{p: p, topic: a.topic, done: make(chan struct{})}
	go func() {
		defer close(f.done)
		succ, errs := p.Successes(), p.Errors()
		for succ != nil || errs != nil {
			select {
			case _, ok := <-succ:
				if !ok {
					succ = nil
					continue
				}
				onAck(nil)
			case e, ok := <-errs:
				if !ok {
					errs = nil
					continue
				}
				onAck(e.Err)
			}
		}
	}()
	return f, nil
}

func (f *saramaFloor) send(key, value []byte, sentNs int64) {
	f.p.Input() <- &sarama.ProducerMessage{Topic: f.topic, Key: sarama.ByteEncoder(key), Value: sarama.ByteEncoder(value),
		Headers: []sarama.RecordHeader{{Key: []byte(sentHeader), Value: strconv.AppendInt(nil, sentNs, 10)}}}
}

func (f *saramaFloor) close() {
	f.p.AsyncClose()
	<-f.done
}

// franzFloor is franz-go's client with its defaults (idempotent, acks=all)
// and the same linger and compression.
type franzFloor struct {
	cl    *kgo.Client
	onAck func(error)
}

func newFranzFloor(a floorArgs, onAck func(error)) (*franzFloor, error) {
	opts := []kgo.Opt{kgo.SeedBrokers(strings.Split(a.brokers, ",")...), kgo.DefaultProduceTopic(a.topic),
		kgo.ProducerLinger(a.linger), kgo.ClientID("bench-floor")}
	if a.compression == "lz4" {
		opts = append(opts, kgo.ProducerBatchCompression(kgo.Lz4Compression()))
	} else {
		opts = append(opts, kgo.ProducerBatchCompression(kgo.NoCompression()))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("franz-go producer: %w", err)
	}
	return &franzFloor{cl: cl, onAck: onAck}, nil
}

func (f *franzFloor) send(key, value []byte, sentNs int64) {
	f.cl.Produce(context.Background(), &kgo.Record{Key: key, Value: value,
		Headers: []kgo.RecordHeader{{Key: sentHeader, Value: strconv.AppendInt(nil, sentNs, 10)}}},
		func(_ *kgo.Record, err error) { f.onAck(err) })
}

func (f *franzFloor) close() { f.cl.Close() }

// floorProcess is a floor child while it runs.
type floorProcess struct {
	cmd       *exec.Cmd
	measuring chan int64 // the Unix ns of the first measured record
	result    chan floorReport
	done      chan error
}

// startFloorProcess runs this binary as a floor producer.
func startFloorProcess(a floorArgs) (*floorProcess, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find the bench binary: %w", err)
	}
	cmd := exec.Command(self, childFloor, "--client", a.client, "--brokers", a.brokers, "--topic", a.topic,
		"--rate", fmt.Sprint(a.rate), "--duration", a.duration.String(), "--warm", a.warm.String(),
		"--linger", a.linger.String(), "--compression", a.compression,
		"--payload", fmt.Sprint(a.payload), "--aggregates", fmt.Sprint(a.aggregates))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start floor producer: %w", err)
	}
	p := &floorProcess{cmd: cmd, measuring: make(chan int64, 1), result: make(chan floorReport, 1), done: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			if ns, ok := strings.CutPrefix(line, "measuring "); ok {
				if v, err := strconv.ParseInt(ns, 10, 64); err == nil {
					p.measuring <- v
				}
				continue
			}
			var r floorReport
			if json.Unmarshal([]byte(line), &r) == nil {
				p.result <- r
			}
		}
		p.done <- cmd.Wait()
	}()
	return p, nil
}

// wait returns the child's report once it exits.
func (p *floorProcess) wait(ctx context.Context, timeout time.Duration) (floorReport, error) {
	select {
	case err := <-p.done:
		select {
		case r := <-p.result:
			if r.Error != "" {
				return r, errors.New(r.Error)
			}
			return r, nil
		default:
			return floorReport{}, fmt.Errorf("floor producer exited without a report: %v", err)
		}
	case <-time.After(timeout):
	case <-ctx.Done():
	}
	syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
	return floorReport{}, fmt.Errorf("floor producer did not finish within %s", timeout)
}
