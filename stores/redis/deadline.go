package redis

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// A Reserve whose caller gave up must not create a record long afterwards
// (stores.Store: a store bounds each call itself). Redis has no statement
// timeout, and a server's timeout would not bound it either (the SQL
// stores' statement_timeout counts from when the server has the
// statement; they bound it as here, see sqlstore.SendDeadline): a script
// held up in the network (a partition that drops packets, after which the
// kernel delivers the request it had accepted, even from a socket its
// caller closed) runs whenever it arrives. Landing after the handler's undo
// of the lost Reserve had ended (its settle window, 10 s), it left a record
// in flight that nothing had sent to the catalog, and the key's retries
// heard "unknown" for the record's whole TTL. So a Reserve carries the
// moment, on the server's clock, after which it does nothing: the end of
// its call there. So does a TakeOver, which landing so would hand the
// record to an owner that never executes (see Store.TakeOver), and a
// lease renewal, which would revive the lease of a record its owner had
// marked abandoned (see Store.ExtendLease). Only on a single address: the
// nodes of a Cluster each have a clock, and a key's node need not be the
// one whose clock was read.

// ClockMargin is added to a call's end on the server's clock, for a clock
// stepped back (NTP) since the offset was last measured: a live call must
// never be refused as late. A larger step makes the server refuse one all
// the same, and Reserve sends it again with the offset the refusal read.
const ClockMargin = time.Second

// serverClock tracks how far the server's clock is ahead of this node's.
type serverClock struct {
	// ahead is an upper bound, in milliseconds, of the server's clock
	// minus this node's: the server's time read by a call, minus the
	// node's time when the call was sent. Valid once known is set.
	ahead atomic.Int64
	known atomic.Bool
}

// learn records the server time t (milliseconds) that a call sent at sent
// read.
func (c *serverClock) learn(t int64, sent time.Time) {
	c.ahead.Store(t - sent.UnixMilli())
	c.known.Store(true)
}

// notAfter is the moment, in the server's milliseconds, after which a call
// that ends at deadline on this node comes too late: 0, no bound, when the
// server's clock is not known yet or the call has no deadline.
func (c *serverClock) notAfter(deadline time.Time, ok bool) int64 {
	if !ok || !c.known.Load() {
		return 0
	}
	return deadline.Add(ClockMargin).UnixMilli() + c.ahead.Load()
}

// syncClock reads the server's clock once, before the first Reserve: the
// offset comes from every Reserve's reply afterwards. When the server
// could not be reached, the Reserve is not sent at all, and its error says
// so (stores.NotSent): the script never left this node. When the server
// answered with an error (it is loading, or wants a login), the script is
// sent unbounded, as before, and its own reply tells what happened.
func (s *Store) syncClock(ctx context.Context) error {
	if s.clock.known.Load() || s.resends() {
		return nil
	}
	select {
	case <-s.closed:
		return nil // the Reserve reports it
	default:
	}
	sent := time.Now()
	t, err := s.client.Time(ctx).Result()
	var reply goredis.Error
	if errors.As(err, &reply) {
		return nil
	}
	if err != nil {
		return stores.MarkNotSent(s.wrap("reserve: reading the server's clock", err))
	}
	s.clock.learn(t.UnixMilli(), sent)
	return nil
}
