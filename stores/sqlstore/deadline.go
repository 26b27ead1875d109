package sqlstore

import (
	"context"
	"sync"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// A write that creates a reservation (Reserve's INSERT, TakeOver's UPDATE)
// or renews one (ExtendLease's UPDATE) must not land long after its caller
// gave up. The server's statement_timeout (PostgreSQL) or
// innodb_lock_wait_timeout (MySQL) does not bound that: it counts from when
// the server receives the statement, and a statement held up in the
// network (a partition that drops packets, after which the kernel delivers
// what it had accepted, even from a socket its caller closed) runs
// whenever it arrives. Landing after the handler's undo of the lost write
// had ended (its settle window), a reservation left a record in flight
// that nothing had sent to the catalog, and the key's retries heard
// "unknown" for the record's whole TTL; a renewal revived the lease of a
// record its owner had marked abandoned, and the retries heard "in
// flight" for a whole lease. So such a statement carries the end of the
// call that sends it, on the server's clock (SendDeadline, which the store
// fills in as it sends), and the server refuses it after that, with an
// error: nothing is written, and a combined batch holding it rolls back as
// for any refused statement.

// ClockMargin is added to a call's end on the server's clock, for a clock
// stepped back (NTP) since the offset was last measured: a live call must
// never be refused as late.
const ClockMargin = time.Second

// ClockMaxAge is how long a reading of the server's clock is used before
// the next Reserve reads it again (drift, a stepped clock, a failover to
// another server).
const ClockMaxAge = time.Minute

// sendDeadline stands, among a statement's arguments, for the moment after
// which the server refuses it: see ServerClock.Fill.
type sendDeadline struct{}

// SendDeadline is the argument a statement bounded by its call's end
// carries until it is sent; ServerClock.Fill replaces it.
var SendDeadline any = sendDeadline{}

// ServerClock tracks how far the database server's clock is ahead of this
// node's. The zero value knows nothing yet.
type ServerClock struct {
	mu      sync.Mutex
	ahead   time.Duration // upper bound of the server's clock minus this node's
	known   bool          // ahead was measured once
	readAt  time.Time     // when ahead was measured; zero: to be read before the next call
	reading *clockRead    // the read under way, a refresh or for lack of a reading; nil: none
	reads   int           // reads that succeeded, for tests
}

// clockRead is one read of the server's clock, which callers without a
// reading share: err is set before done is closed.
type clockRead struct {
	done chan struct{}
	err  error
}

// Learn records the server time server that a call sent at sent read: its
// difference is an upper bound of how far the server is ahead (the call
// took some time to get there), so that a bound drawn from it never comes
// early for a live call.
func (c *ServerClock) Learn(server, sent time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ahead, c.known, c.readAt = server.Sub(sent), true, time.Now()
}

// Forget asks for a new reading: the server refused a call as late, which
// only a clock that moved since the reading explains. The next Sync reads
// it before its call goes; calls already on their way keep the old one
// (never none: a statement must not go out unbounded).
func (c *ServerClock) Forget() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.readAt = time.Time{}
}

// Expire makes the reading as old as ClockMaxAge, as a minute without a
// bounded call does: the next call refreshes it first, and keeps it if the
// refresh fails. Tests use it.
func (c *ServerClock) Expire() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.readAt.IsZero() {
		c.readAt = time.Now().Add(-ClockMaxAge)
	}
}

// Sync reads the server's clock with read when no reading is known, or
// when the known one is older than ClockMaxAge. Without a reading, the
// callers share one read (under the ctx of the caller that started it) and
// its error is theirs: a statement must not go out unbounded. (Each
// reading in turn, they waited a read's timeout per caller ahead of them
// while the server did not answer; the handler's Reserve has no deadline
// of its own.) A caller whose ctx ends while it waits gives up, with
// nothing sent. An old reading is refreshed by one caller at a time; the
// others, and that caller if the read fails, go on with it (callers that
// a refusal left without a reading meanwhile share the refresh).
func (c *ServerClock) Sync(ctx context.Context, read func(ctx context.Context) (server, sent time.Time, err error)) error {
	c.mu.Lock()
	if !c.readAt.IsZero() {
		var refresh *clockRead
		if time.Since(c.readAt) >= ClockMaxAge && c.reading == nil {
			refresh = c.startRead()
		}
		c.mu.Unlock()
		if refresh != nil {
			_ = c.runRead(ctx, refresh, read) // on failure, the old reading serves
		}
		return nil
	}
	if r := c.reading; r != nil {
		c.mu.Unlock()
		select {
		case <-r.done:
			return r.err
		case <-ctx.Done():
			return stores.MarkNotSent(ctx.Err())
		}
	}
	r := c.startRead()
	c.mu.Unlock()
	return c.runRead(ctx, r, read)
}

// startRead notes a read under way; c.mu is held.
func (c *ServerClock) startRead() *clockRead {
	c.reading = &clockRead{done: make(chan struct{})}
	return c.reading
}

// runRead reads the server's clock for r, learns it, and hands its outcome
// to the callers waiting for r.
func (c *ServerClock) runRead(ctx context.Context, r *clockRead, read func(ctx context.Context) (server, sent time.Time, err error)) error {
	server, sent, err := read(ctx)
	if err == nil {
		c.Learn(server, sent)
	}
	c.mu.Lock()
	c.reading = nil
	if err == nil {
		c.reads++
	}
	c.mu.Unlock()
	r.err = err
	close(r.done)
	return err
}

// Reads reports how many reads of the server's clock succeeded; tests use
// it.
func (c *ServerClock) Reads() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reads
}

// Bounded reports whether a statement's args carry SendDeadline: a
// Reserve's or TakeOver's, which the server refuses after its call's end.
func Bounded(args []any) bool {
	for _, a := range args {
		if _, ok := a.(sendDeadline); ok {
			return true
		}
	}
	return false
}

// NotAfter is the moment, on the server's clock, after which a call that
// ends at deadline on this node comes too late (in UTC); nil, no bound,
// when the server's clock is not known or the call has no deadline.
func (c *ServerClock) NotAfter(deadline time.Time, ok bool) any {
	c.mu.Lock()
	ahead, known := c.ahead, c.known
	c.mu.Unlock()
	if !ok || !known {
		return nil
	}
	return deadline.Add(ClockMargin + ahead).UTC()
}

// Fill returns args with SendDeadline replaced by the end of the call ctx
// bounds, on the server's clock (NotAfter); args itself is left as it is,
// since a statement may be sent again. Statements without it come back
// unchanged.
func (c *ServerClock) Fill(ctx context.Context, args []any) []any {
	for i, a := range args {
		if _, ok := a.(sendDeadline); ok {
			out := make([]any, len(args))
			copy(out, args)
			out[i] = c.NotAfter(ctx.Deadline())
			return out
		}
	}
	return args
}
