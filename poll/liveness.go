package poll

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/tcpdial"
	"github.com/outbox-relay/outbox-relay/pipeline"
)

// ErrConnectionDead ends a poller's session one of whose PostgreSQL
// connections gave no answer within its bound: the connection is taken
// for dead and the session made again. A proxy, NAT or load balancer in
// the path that dropped the connection without closing it would otherwise
// keep the poller waiting for ever, ready and publishing nothing.
var ErrConnectionDead = errors.New("PostgreSQL connection gave no answer")

// deadAfter is --pg-timeout.
func (p *Poller) deadAfter() time.Duration {
	if d := p.cfg.Postgres.DeadAfter; d > 0 {
		return d
	}
	return tcpdial.DefaultDeadAfter
}

// proofEvery is how often an idle session is proved alive, and how long
// a proof may take: a third of --pg-timeout, so a dead connection is
// noticed within two thirds of it while idle.
func (p *Poller) proofEvery() time.Duration { return max(p.deadAfter()/3, time.Second) }

// prover proves one of a session's connections alive. Only the goroutine
// that owns the connection proves it (a pgx.Conn is not safe for
// concurrent use); provedAt may be read from any.
type prover struct {
	p    *Poller
	conn *pgx.Conn
	// name says which connection, for the operator.
	name string
	// provedAt is when the last statement that then succeeded was sent
	// (UnixNano): the server had heard from the session then.
	provedAt atomic.Int64
}

func (p *Poller) newProver(conn *pgx.Conn, name string) *prover {
	v := &prover{p: p, conn: conn, name: name}
	v.proved(time.Now())
	return v
}

func (v *prover) proved(sent time.Time) { v.provedAt.Store(sent.UnixNano()) }

// since is how long ago the connection was last proved alive.
func (v *prover) since() time.Duration { return time.Since(time.Unix(0, v.provedAt.Load())) }

// due is when the next proof is due.
func (v *prover) due() time.Time {
	return time.Unix(0, v.provedAt.Load()).Add(v.p.proofEvery())
}

// prove runs a bounded SELECT 1 unless the connection answered within a
// third of --pg-timeout. It returns nil once ctx ended.
func (v *prover) prove(ctx context.Context) error {
	if v.since() < v.p.proofEvery() {
		return nil
	}
	return v.bounded(ctx, v.p.proofEvery(), func(ctx context.Context) error {
		_, err := v.conn.Exec(ctx, "SELECT 1")
		return err
	})
}

// bounded runs f, one statement or a few on the connection, under bound:
// once it succeeds the connection is proved; when bound passes first it is
// taken for dead. Other failures, and ctx's end, are f's.
func (v *prover) bounded(ctx context.Context, bound time.Duration, f func(ctx context.Context) error) error {
	sctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	sent := time.Now()
	err := f(sctx)
	if err == nil {
		v.proved(sent)
		return nil
	}
	if ctx.Err() != nil {
		return err
	}
	if sctx.Err() != nil {
		return v.dead(bound, err)
	}
	return err
}

// timedOut reports whether err is a statement's own deadline passing.
func timedOut(err error) bool {
	return errors.Is(err, context.DeadlineExceeded)
}

// dead is the error that ends the session: which connection, its bound,
// and what happens next. The poller reports itself not ready at once: a
// session's teardown may take a while over a dead link.
func (v *prover) dead(bound time.Duration, err error) error {
	e := fmt.Errorf("%w: the poller's %s connection had no answer within %s (%w); taking it for dead (a NAT, load balancer, proxy or firewall that dropped it, or a failed host) and connecting again (--pg-timeout %s bounds this wait)",
		ErrConnectionDead, v.name, bound, err, v.p.deadAfter())
	v.p.setState(pipeline.StateBackingOff, e)
	return e
}

// proofTimer is a timer that fires when v's next proof is due.
func proofTimer(v *prover) *time.Timer { return time.NewTimer(max(time.Until(v.due()), 0)) }
