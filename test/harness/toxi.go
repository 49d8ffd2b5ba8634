package harness

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/Shopify/toxiproxy/v2/toxics"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// Toxi is toxiproxy, in process, in front of one server: the network
// faults of the field (a black hole, latency with jitter, a bandwidth cap)
// on every connection a test's process makes through it. The harness's
// own Proxy stays for what toxiproxy does not do: cutting connections at
// an exact moment, and refusing new ones.
type Toxi struct {
	proxy *toxiproxy.Proxy
	mu    sync.Mutex
	names []string
}

var registerBlackHole sync.Once

// StartToxi listens on 127.0.0.1 on a free port and forwards every
// connection to upstream (host:port); it is stopped when the test ends.
func StartToxi(t testing.TB, upstream string) *Toxi {
	t.Helper()
	x, err := newToxi(upstream)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.stop)
	return x
}

// newToxi starts a proxy whose lifetime the caller owns (stop): an Apache
// Kafka cluster shared by a package's tests keeps its proxies as long as
// its brokers. upstream need not listen yet.
func newToxi(upstream string) (*Toxi, error) {
	registerBlackHole.Do(func() { toxics.Register("black_hole", new(blackHole)) })
	server := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	p := toxiproxy.NewProxy(server, "toxi-"+strings.ReplaceAll(upstream, ":", "-"), "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		return nil, fmt.Errorf("start toxiproxy in front of %s: %w", upstream, err)
	}
	return &Toxi{proxy: p}, nil
}

func (x *Toxi) stop() { x.proxy.Stop() }

// Addr is the proxy's host:port.
func (x *Toxi) Addr() string { return x.proxy.Listen }

// BlackHole drops everything on every connection, both ways, from now on,
// and never closes one: a peer gone without a FIN or an RST, as when a NAT
// or a load balancer drops a connection's state. New connections are
// accepted and black-holed too, until Heal.
func (x *Toxi) BlackHole(t testing.TB) {
	t.Helper()
	x.add(t, "black_hole", "upstream", nil)
	x.add(t, "black_hole", "downstream", nil)
}

// Slow adds latency with jitter (milliseconds) and caps the bandwidth
// (KB/s, 0: none) both ways.
func (x *Toxi) Slow(t testing.TB, latencyMS, jitterMS, rateKBps int) {
	t.Helper()
	for _, dir := range []string{"upstream", "downstream"} {
		x.add(t, "latency", dir, map[string]int{"latency": latencyMS, "jitter": jitterMS})
		if rateKBps > 0 {
			x.add(t, "bandwidth", dir, map[string]int{"rate": rateKBps})
		}
	}
}

// SlowUpstream is Slow for what the client sends alone: what the server
// sends comes at full speed.
func (x *Toxi) SlowUpstream(t testing.TB, latencyMS, jitterMS, rateKBps int) {
	t.Helper()
	x.add(t, "latency", "upstream", map[string]int{"latency": latencyMS, "jitter": jitterMS})
	if rateKBps > 0 {
		x.add(t, "bandwidth", "upstream", map[string]int{"rate": rateKBps})
	}
}

// Heal removes every fault. A connection black-holed is closed then, as
// the dead connection it stands for would be once noticed.
func (x *Toxi) Heal(t testing.TB) {
	t.Helper()
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, name := range x.names {
		if err := x.proxy.Toxics.RemoveToxic(context.Background(), name); err != nil {
			t.Fatalf("remove toxic %s: %v", name, err)
		}
	}
	x.names = nil
}

func (x *Toxi) add(t testing.TB, kind, stream string, attrs map[string]int) {
	x.mu.Lock()
	defer x.mu.Unlock()
	name := fmt.Sprintf("%s_%s_%d", kind, stream, len(x.names))
	body := fmt.Sprintf(`{"name":%q,"type":%q,"stream":%q,"attributes":{`, name, kind, stream)
	first := true
	for k, v := range attrs {
		if !first {
			body += ","
		}
		body += fmt.Sprintf("%q:%d", k, v)
		first = false
	}
	body += "}}"
	if _, err := x.proxy.Toxics.AddToxicJson(strings.NewReader(body)); err != nil {
		t.Fatalf("add toxic %s: %v", body, err)
	}
	x.names = append(x.names, name)
}

// blackHole drops what comes and, unlike toxiproxy's timeout toxic, does
// not pass on the other side's close either: the PostgreSQL walsender that
// times out and exits would otherwise tell the relay through the proxy,
// which a real black hole never does.
type blackHole struct{}

func (blackHole) Pipe(stub *toxics.ToxicStub) {
	input := stub.Input
	for {
		select {
		case <-stub.Interrupt:
			return
		case c := <-input:
			if c == nil {
				input = nil // closed: wait for the toxic's removal alone
			}
		}
	}
}

// Cleanup ends the link once the toxic is removed.
func (blackHole) Cleanup(stub *toxics.ToxicStub) { stub.Close() }
